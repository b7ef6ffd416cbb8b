"""What an operator sees and relies on: /health, /metrics, a client that disconnects mid-stream
(its session freed on every worker, what was generated billed), and the dashboard in a real
browser (headless Chromium) showing every worker and its layer range."""

from __future__ import annotations

import tempfile
import time
from html.parser import HTMLParser
from pathlib import Path

import openai
import pytest

from conftest import ARTIFACTS, check_dashboard_in_browser, chromium, http_get, wait_until


def test_health_is_200_while_the_swarm_covers_the_model(swarm):
    status, _, body = http_get(f"{swarm.root}/health")
    assert status == 200, f"/health: {status} {body!r}"
    assert swarm.model in body.decode(), f"/health does not name {swarm.model}: {body!r}"


def test_gateway_metrics_count_requests_latency_and_errors(swarm, client):
    client.completions.create(model=swarm.model, prompt="Hello", max_tokens=3)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=swarm.model, prompt="Hello", max_tokens=3, extra_body={"no_such_field": 1})
    m = swarm.gateway_metrics()
    requests = {k: v for k, v in m.items() if k.startswith("dgr_gateway_requests_total{")}
    assert any('key="free"' in k and v >= 1 for k, v in requests.items()), f"no requests counted for the key 'free': {requests}"
    assert m.get("dgr_gateway_ttft_seconds_count", 0) >= 1, "the TTFT histogram has no observation"
    assert 'dgr_gateway_ttft_seconds_bucket{le="+Inf"}' in m, "the TTFT histogram has no +Inf bucket"
    errors = {k: v for k, v in m.items() if k.startswith("dgr_gateway_errors_total{")}
    assert sum(errors.values()) >= 1, f"the refused request is not among the errors: {errors}"


def test_a_client_that_disconnects_mid_stream_frees_every_worker_and_is_billed(swarm):
    client = swarm.client("stream")
    assert "stream" not in swarm.usage(), "the key 'stream' is for this test only"
    stream = client.completions.create(
        model=swarm.model, prompt="Once upon a time", max_tokens=400, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = iter(stream)
    for _ in range(3):
        assert next(chunks).choices[0].text is not None
    open_now = {addr: m["dgr_worker_sessions_open"] for addr, m in swarm.worker_metrics().items()}
    assert all(n == 1 for n in open_now.values()), f"while streaming, sessions open per worker: {open_now}"
    stream.close()  # closes the connection mid-stream
    closed = time.monotonic()

    def freed():
        state = {a: (m["dgr_worker_sessions_open"], m["dgr_worker_kv_bytes_used"]) for a, m in swarm.worker_metrics().items()}
        return all(v == (0, 0) for v in state.values()) and state

    wait_until("every worker's sessions_open and kv_bytes_used to be 0", freed, timeout=1.0)
    took = time.monotonic() - closed
    row = wait_until("the ledger to record the disconnected request", lambda: swarm.usage().get("stream"), timeout=5, interval=0.1)
    assert row["requests"] == 1, row
    assert 0 < row["completion_tokens"] < 400, f"billed {row['completion_tokens']} completion tokens of a stream cut after 3 chunks (freed in {took:.2f} s)"


def test_dashboard_shows_every_worker_and_its_layers_in_a_browser(swarm):
    workers = check_dashboard_in_browser(swarm, "dashboard")
    assert len(workers) == 2, f"dgr up --workers 2 should list two workers: {workers}"


class Charts(HTMLParser):
    """The dashboard's chart elements (<div class="chart" id=... data-points=N>) and body's data-charts."""

    def __init__(self):
        super().__init__()
        self.points: dict[str, int] = {}
        self.drawn = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "body":
            self.drawn = a.get("data-charts")
        if tag == "div" and "chart" in (a.get("class") or "").split():
            self.points[a.get("id")] = int(a.get("data-points") or 0)


def test_dashboard_charts_a_32_stream_load_and_counts_tokens_while_they_run(swarm):
    import json
    import threading

    client = swarm.client()
    # A prompt of several 16-token blocks, twice: the second is served from the prefix caches.
    shared = "The committee met on Tuesday to review the quarterly figures and the plans for next year. " * 4
    for _ in range(2):
        client.completions.create(model=swarm.model, prompt=shared, max_tokens=2, temperature=0)
    done: list[int] = []
    errors: list[BaseException] = []

    def stream():
        try:
            s = client.completions.create(model=swarm.model, prompt="Tell me a long story about", max_tokens=96,
                                          temperature=0, stream=True, extra_body={"ignore_eos": True})  # fmt: skip
            n = sum(1 for c in s if c.choices and c.choices[0].text)
            done.append(n)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=stream) for _ in range(32)]
    for t in threads:
        t.start()

    def state():
        return json.loads(http_get(f"{swarm.root}/dashboard/state")[2])

    # The tokens/s card counts tokens as they stream, not when requests end.
    live = wait_until("the dashboard's tokens/s to be above 0 under load", lambda: state()["tokens_per_s"] > 0, timeout=30, interval=0.2)
    finished_then = len(done)
    assert live and finished_then < 32, f"tokens/s became non-zero only after {finished_then} of 32 streams had finished"
    with tempfile.TemporaryDirectory(prefix="dgr-chromium-") as profile:
        dom = chromium("--dump-dom", swarm.root + "/", profile=Path(profile)).stdout
        shot = ARTIFACTS / "dashboard-charts.png"
        chromium(f"--screenshot={shot}", "--window-size=1280,1400", "--hide-scrollbars", swarm.root + "/", profile=Path(profile))
    for t in threads:
        t.join(timeout=300)
    assert not errors, f"{len(errors)} of 32 streams failed: {errors[:3]}"
    assert len(done) == 32 and all(n > 0 for n in done), done
    (ARTIFACTS / "dashboard-charts.html").write_text(dom)
    page = Charts()
    page.feed(dom)
    assert page.drawn == "1", "the dashboard drew no charts (no data-charts=1 on body)"
    expected = {"c-tps", "c-ttft", "c-itl", "c-queue", "c-kv", "c-step", "c-cache"}
    assert set(page.points) == expected, f"charts on the page: {page.points}"
    empty = [c for c, n in page.points.items() if n == 0]
    assert not empty, f"charts without data under a 32-stream load: {empty} ({page.points})"
    assert shot.is_file() and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"no PNG screenshot at {shot}"

    # The chart's data endpoint holds the load's points. It samples every `step_s`, so the last
    # tokens of the load reach it with the next sample: wait for that, with a deadline.
    total = sum(done)

    def series():
        return json.loads(http_get(f"{swarm.root}/dashboard/series")[2])

    def counted(h):
        return sum(v * h["step_s"] for v in h["tokens_per_s"])

    wait_until("the history to count the load's tokens", lambda: counted(series()) >= 0.8 * total, timeout=10, interval=0.5)
    h = series()
    n = len(h["t"])
    assert n >= 2 and all(len(h[k]) == n for k in ("tokens_per_s", "ttft_p50_ms", "itl_p99_ms", "running", "kv_used_frac")), h
    assert max(h["tokens_per_s"]) > 0, f"no tokens/s in the history: {h['tokens_per_s']}"
    assert max(h["running"]) >= 2, f"the history never saw the streams running: {h['running']}"
    assert any(v is not None and v > 0 for v in h["ttft_p50_ms"]), f"no TTFT in the history: {h['ttft_p50_ms']}"
    assert any(v is not None and v > 0 for v in h["itl_p50_ms"]), f"no inter-token latency in the history: {h['itl_p50_ms']}"
    assert any(v is not None and v > 0 for v in h["kv_used_frac"]), f"the history never saw KV in use: {h['kv_used_frac']}"
    assert any(v is not None and v > 0 for v in h["cache_hit_frac"]), f"the history never saw a cache hit: {h['cache_hit_frac']}"
    assert len(h["workers"]) == 2 and all(any(v for v in w["step_ms"] if v) for w in h["workers"]), h["workers"]
    generated = counted(h)
    assert generated >= 0.8 * total, f"the history counts {generated:.0f} tokens generated, the streams got {total}"
