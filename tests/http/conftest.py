"""The gateway's acceptance suite: one `dgr up` swarm for the whole session.

`dgr up --workers 2` starts a tracker, two workers and the OpenAI-compatible gateway on loopback,
with its tracker state in a fresh `$DGR_STATE_DIR` (so the ledger and keys start empty) and four
API keys registered from `--api-keys`. Every test talks to that swarm; the last one (`shutdown`)
stops it with Ctrl-C and checks that no process is left behind.

Environment: DGR_BIN (default: target/release/dgr), DGR_MODEL (default: dgr's default model),
DGR_TEST_ARTIFACTS (default: target/test-artifacts; the dashboard screenshot and logs go there).
"""

from __future__ import annotations

import json
import os
import re
import selectors
import signal
import struct
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import openai
import pytest

REPO = Path(__file__).resolve().parents[2]
DGR = Path(os.environ.get("DGR_BIN", REPO / "target" / "release" / "dgr"))
ARTIFACTS = Path(os.environ.get("DGR_TEST_ARTIFACTS", REPO / "target" / "test-artifacts"))
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")

# Gateway limits the suite starts `dgr up` with (small, so oversized requests are cheap to make).
MAX_PROMPT_TOKENS = 256
MAX_TOKENS_LIMIT = 512
MAX_BODY_BYTES = 64 * 1024
SMALL_QUOTA = 40

# name, key, quota (0: none). "free" is the default key of the tests; "small" has a quota the
# quota test uses up; "stream" is used only by the disconnect test, so its ledger row is its own.
KEYS = {
    "free": ("sk-free-0123456789abcdef0123456789", 0),
    "small": ("sk-small-0123456789abcdef012345678", SMALL_QUOTA),
    "stream": ("sk-stream-0123456789abcdef01234567", 0),
    "cold": ("sk-cold-0123456789abcdef0123456789a", 0),
}


# ---------------------------------------------------------------------------------------------
# Ordering and no skipping
# ---------------------------------------------------------------------------------------------


def pytest_configure(config):
    config.addinivalue_line("markers", "shutdown: stops the session's swarm, so it runs last")


def pytest_collection_modifyitems(session, config, items):
    """Tests marked `shutdown` run after every other test (they stop the shared swarm)."""
    items.sort(key=lambda item: item.get_closest_marker("shutdown") is not None)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A skipped test is a failed one: a missing model, browser or package must not pass quietly."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"skipped, which this suite counts as a failure: {report.longrepr}"


# ---------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------


def wait_until(what: str, check, timeout: float, interval: float = 0.02):
    """Polls `check()` until it returns something truthy; fails naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        last = check()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what} (last seen: {last!r})")
        time.sleep(interval)


def http_get(url: str, timeout: float = 10) -> tuple[int, dict, bytes]:
    """GET without raising on 4xx/5xx: (status, headers, body)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def parse_prometheus(text: str) -> dict[str, float]:
    """Samples of a Prometheus text exposition, keyed by name with labels as written."""
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^(\S+?(?:\{.*\})?)\s+(\S+)$", line)
        assert m, f"not a Prometheus sample line: {line!r}"
        samples[m.group(1)] = float(m.group(2))
    return samples


def run_dgr(*args: str, timeout: float = 60) -> str:
    r = subprocess.run([str(DGR), *args], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"dgr {' '.join(args)} exited {r.returncode}: {r.stderr.strip()}"
    return r.stdout


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (children, grandchildren, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        # The command name may contain spaces and parentheses: the fields after its last ')'.
        fields = stat[stat.rindex(")") + 2 :].split()
        children.setdefault(int(fields[1]), []).append(int(d.name))
    found, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in found:
                found.add(c)
                todo.append(c)
    return found


def alive(pid: int) -> bool:
    """Whether `pid` is a process that has not exited (a zombie has exited)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


# ---------------------------------------------------------------------------------------------
# The dashboard in a browser
# ---------------------------------------------------------------------------------------------


class WorkerRows(HTMLParser):
    """The dashboard's <tr class="worker" data-worker=ID data-layers="A..B"> rows and body's data-ready."""

    def __init__(self):
        super().__init__()
        self.rows: dict[str, str] = {}
        self.ready = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "body":
            self.ready = a.get("data-ready")
        if tag == "tr" and "worker" in (a.get("class") or "").split():
            self.rows[a.get("data-worker")] = a.get("data-layers")


def chromium(*args: str, profile: Path) -> subprocess.CompletedProcess:
    assert Path(CHROMIUM).is_file(), f"{CHROMIUM} is missing (scripts/test-http.sh installs Debian's chromium)"
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
           f"--user-data-dir={profile}", "--virtual-time-budget=5000", *args]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, f"chromium exited {r.returncode}: {r.stderr[-2000:]}"
    return r


def check_dashboard_in_browser(swarm: "Swarm", name: str, *flags: str) -> dict[str, str]:
    """Loads the swarm's dashboard in headless Chromium (with `flags`), checks it rendered every
    worker the tracker lists with its layers and the model's coverage, and screenshots it into
    the artifacts as NAME.png (its DOM as NAME.html). Returns the workers' rows."""
    model = swarm.swarm_json()["models"][0]
    expected = {w["worker_id"]: f"{w['layers'][0]}..{w['layers'][1]}" for w in model["workers"]}
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / f"{name}.png"
    shot.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="dgr-chromium-") as profile:
        dom = chromium(*flags, "--dump-dom", swarm.root + "/", profile=Path(profile)).stdout
        (ARTIFACTS / f"{name}.html").write_text(dom)
        page = WorkerRows()
        page.feed(dom)
        assert page.ready == "1", "the dashboard's script did not render (no data-ready=1 on body)"
        assert page.rows == expected, f"dashboard rows {page.rows} != the tracker's workers {expected}"
        covered = f"{model['n_layers']} layers, covered"
        assert covered in dom, f"the dashboard does not say {covered!r}"

        chromium(*flags, f"--screenshot={shot}", "--window-size=1280,900", "--hide-scrollbars", swarm.root + "/", profile=Path(profile))
    assert shot.is_file(), f"no screenshot at {shot}"
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n", "the screenshot is not a PNG"
    width, height = struct.unpack(">II", png[16:24])
    assert (width, height) == (1280, 900), f"screenshot is {width}x{height}"
    assert len(png) > 20_000, f"a {len(png)}-byte screenshot is too small to show a rendered page"
    return page.rows


# ---------------------------------------------------------------------------------------------
# The swarm
# ---------------------------------------------------------------------------------------------


@dataclass
class Swarm:
    """A running `dgr up` and what the tests need to talk to it."""

    proc: subprocess.Popen
    base_url: str  # http://127.0.0.1:PORT/v1
    model: str
    tracker: str
    state_dir: Path
    log: Path
    clients: list = field(default_factory=list)
    _worker_addrs: list = field(default_factory=list)

    @property
    def root(self) -> str:
        """http://127.0.0.1:PORT (the dashboard, /health and /metrics)."""
        return self.base_url.removesuffix("/v1")

    def client(self, key: str | None = "free", **kw) -> openai.OpenAI:
        """An official OpenAI client with one of the suite's keys (or any key string)."""
        api_key = KEYS[key][0] if key in KEYS else key
        # No retries: a 429 must reach the test, not be waited out (Retry-After may be 60 s).
        kw.setdefault("timeout", 60)
        c = openai.OpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, **kw)
        self.clients.append(c)
        return c

    # The tracker's view -----------------------------------------------------------------------

    def swarm_json(self) -> dict:
        return json.loads(run_dgr("swarm", "--tracker", self.tracker, "--format", "json"))

    def workers(self) -> list[dict]:
        """Every worker of the served model as the tracker lists it (id, addr, layers, ...)."""
        models = self.swarm_json()["models"]
        assert len(models) == 1, f"expected one model in the swarm, got {models}"
        return models[0]["workers"]

    def usage(self) -> dict[str, dict]:
        """The ledger by key name: {name: row}."""
        rows = json.loads(run_dgr("usage", "--tracker", self.tracker, "--format", "json"))["rows"]
        return {r["key"]: r for r in rows}

    # The workers' own view --------------------------------------------------------------------

    def worker_addrs(self) -> list[str]:
        """Where the workers listen, as the tracker lists them (asked once: they stay put)."""
        if not self._worker_addrs:
            self._worker_addrs = [w["addr"] for w in self.workers()]
            assert len(self._worker_addrs) == 2 and all(self._worker_addrs), f"dgr up --workers 2 lists {self._worker_addrs}"
        return self._worker_addrs

    def worker_metrics(self) -> dict[str, dict[str, float]]:
        """Each worker's /metrics samples, by worker address."""
        out = {}
        for addr in self.worker_addrs():
            status, _, body = http_get(f"http://{addr}/metrics")
            assert status == 200, f"GET http://{addr}/metrics: {status}"
            out[addr] = parse_prometheus(body.decode())
        return out

    def sessions_opened(self) -> dict[str, float]:
        return {addr: m["dgr_worker_sessions_opened_total"] for addr, m in self.worker_metrics().items()}

    def gateway_metrics(self) -> dict[str, float]:
        status, _, body = http_get(f"{self.root}/metrics")
        assert status == 200, f"GET /metrics: {status}"
        return parse_prometheus(body.decode())


class NoWorkerTouched:
    """`with no_worker_touched(swarm):` asserts no worker opened a session inside the block."""

    def __init__(self, swarm: Swarm):
        self.swarm = swarm

    def __enter__(self):
        self.before = self.swarm.sessions_opened()
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            after = self.swarm.sessions_opened()
            assert after == self.before, f"a refused request reached a worker: sessions opened before {self.before}, after {after}"
        return False


def start_swarm(
    workdir: Path,
    model: Path | None = None,
    max_prompt_tokens: int = MAX_PROMPT_TOKENS,
    log_name: str = "dgr-up.log",
    args: list[str] | None = None,
) -> Swarm:
    """`dgr up` on the default model or on `model`, with the suite's keys and limits, or with `args` instead."""
    assert DGR.is_file(), f"{DGR} is missing: build it with `cargo build --release -p dgr`"
    state = workdir / "state"
    keys = workdir / "api-keys"
    keys.write_text("".join(f"{name} {key} {quota}\n" for name, (key, quota) in KEYS.items()))
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    log = ARTIFACTS / log_name
    env = dict(os.environ, DGR_STATE_DIR=str(state))
    if args is None:
        args = [
            "--workers", "2", "--api-keys", str(keys), "--max-prompt-tokens", str(max_prompt_tokens),
            "--max-tokens-limit", str(MAX_TOKENS_LIMIT), "--max-body-bytes", str(MAX_BODY_BYTES),
        ]  # fmt: skip
    cmd = [str(DGR), "up", "--listen", "127.0.0.1:0", *args, *(["--model", str(model)] if model else [])]
    # Its own process group, as a shell job is: Ctrl-C then reaches dgr up and what it started.
    proc = subprocess.Popen(
        cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=open(log, "wb"), start_new_session=True
    )
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + 60
    line = b""
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not sel.select(timeout=left):
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError(f"dgr up printed no ready line within 60 s; its log:\n{log.read_text()}")
        chunk = os.read(proc.stdout.fileno(), 4096)
        if not chunk:
            proc.wait(timeout=10)
            raise AssertionError(f"dgr up exited ({proc.returncode}) before it was ready; its log:\n{log.read_text()}")
        line += chunk
    ready = json.loads(line)
    if not set(ready) >= {"base_url", "model", "tracker"}:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"unexpected ready line from dgr up: {ready}")
    return Swarm(proc, ready["base_url"], ready["model"], ready["tracker"], state, log)


def stop_swarm(s: Swarm):
    for c in s.clients:
        c.close()
    if s.proc.poll() is None:
        os.killpg(s.proc.pid, signal.SIGINT)
        try:
            s.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(s.proc.pid, signal.SIGKILL)
            s.proc.wait()


@pytest.fixture(scope="session")
def swarm():
    with tempfile.TemporaryDirectory(prefix="dgr-http-") as tmp:
        s = start_swarm(Path(tmp))
        try:
            yield s
        finally:
            # The shutdown test did not stop it (it failed or was deselected): stop it anyway.
            stop_swarm(s)


@pytest.fixture
def no_worker_touched(swarm):
    return lambda: NoWorkerTouched(swarm)


@pytest.fixture(scope="session")
def client(swarm) -> openai.OpenAI:
    """The official client with the quota-free key."""
    return swarm.client("free")
