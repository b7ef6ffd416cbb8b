"""dgr across network namespaces: the tracker, two workers and the gateway on four addresses;
nothing listens beyond loopback unless --listen says so; a link that black-holes for 2 s, with
no replica and with one; a worker that cannot accept connections serving through the relay,
encrypted end to end.

The tests run in file order on one swarm: the relay test replaces worker B with the relayed C,
the last one starts B again beside C."""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
from dataclasses import dataclass

import openai
import pytest
from capture import Capture, varints
from conftest import API_KEY, DGR, HALVES, PORT, Swarm, prometheus, wait_until

QUESTION = "Name three colours of the rainbow."


def client(swarm: Swarm, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=swarm.base_url, api_key=API_KEY, max_retries=0, timeout=kw.pop("timeout", 60), **kw)


def chat(swarm: Swarm, content: str, max_tokens: int, **kw):
    return client(swarm).chat.completions.create(
        model=swarm.gateway.ready["models"][0], messages=[{"role": "user", "content": content}],
        max_tokens=max_tokens, temperature=0, **kw,
    )  # fmt: skip


def sessions_opened(addr: str) -> float:
    return prometheus(f"http://{addr}/metrics")["dgr_worker_sessions_opened_total"]


def test_four_hosts_serve_the_openai_client(swarm: Swarm):
    """Tracker, workers and gateway each in its own namespace; the official client from a fifth."""
    hosts = swarm.net.hosts
    assert swarm.tracker.ready["listening"] == "0.0.0.0:7400", swarm.tracker.ready
    for p in (*swarm.workers, swarm.gateway):
        assert p.ready["listening"].startswith(p.host.addr + ":"), f"{p.name} listens on {p.ready['listening']}"
    workers = [f"{hosts[2].addr}:{PORT}", f"{hosts[3].addr}:{PORT}"]
    before = [sessions_opened(a) for a in workers]

    whole = chat(swarm, QUESTION, 24)
    text = whole.choices[0].message.content
    assert text and whole.usage.completion_tokens == 24, whole
    chunks = chat(swarm, QUESTION, 24, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text, "the streamed answer differs from the same request unstreamed"

    after = [sessions_opened(a) for a in workers]
    assert all(b - a == 2 for a, b in zip(before, after)), f"sessions opened per worker {before} -> {after}: not both on the route"


def test_nothing_listens_beyond_loopback_without_listen(net, swarm: Swarm):
    """With default flags every dgr process binds loopback only; with --listen exactly that address."""
    h6 = net.hosts[6]
    tracker = net.proc("default-tracker", 6, ["tracker", "--join-token-file", str(net.token)])
    tracker.start()
    env = dict(net.env, DGR_TRACKER_KEY=tracker.ready["link_key"])
    worker = net.proc("default-worker", 6, [
        "worker", "--layers", "0..30", "--threads", "1", "--tracker", tracker.ready["listening"],
        "--join-token-file", str(net.token), *net.model(),
    ], env)  # fmt: skip
    gateway = net.proc("default-gateway", 6, ["gateway", "--tracker", tracker.ready["listening"], *net.model()], env)
    up = net.proc("default-up", 5, ["up", "--workers", "2", *net.model()])
    up.spawn()
    worker.start()
    gateway.start()
    up.await_ready(90)
    try:
        for host, procs in ((h6, 3), (net.hosts[5], 4)):  # dgr up: its tracker, two workers, its gateway
            bound = wait_until(f"{procs} dgr sockets in {host.ns}", lambda: (lambda b: b if len(b) >= procs else None)(
                {a for a, who in host.listening() if '"dgr"' in who}), 10)  # fmt: skip
            beyond = {a for a in bound if not (a.startswith("127.") or a.startswith("[::1]"))}
            assert not beyond, f"with default flags dgr binds {sorted(beyond)} in {host.ns} (all: {sorted(bound)})"
    finally:
        for p in (up, gateway, worker, tracker):
            p.stop()
    # The swarm's processes were given --listen: each binds that address and nothing else.
    for p in (swarm.tracker, *swarm.workers, swarm.gateway):
        bound = {a for a, who in p.host.listening() if f"pid={p.popen.pid}," in who}
        assert bound == {p.ready["listening"]}, f"{p.name} with --listen {p.ready['listening']} binds {sorted(bound)}"


@dataclass
class Holed:
    """A streamed answer across a 2 s black hole: its pieces and their arrival times, the hole's
    host, start and end, and the error the stream ended with, if any."""

    parts: list[str]
    times: list[float]
    host: str
    start: float
    end: float
    error: openai.APIError | None
    elapsed: float
    # When the stream ended (with its last piece or its error).
    ended: float

    def stall(self) -> float:
        return max(b - a for a, b in zip(self.times, self.times[1:]))


def stream_across_black_hole(swarm: Swarm, max_tokens: int, hosts_by_worker: dict) -> Holed:
    """Streams a greedy answer; after its 4th piece, the host of the second stage on its route
    (the one of `hosts_by_worker` {worker metrics address or None: Host} holding a session;
    None for a worker without a metrics port) drops every packet but loopback's for 2 s."""
    cut, hole = threading.Event(), {}

    def black_hole():
        cut.wait()
        busy = [a for a in hosts_by_worker if a and prometheus(f"http://{a}/metrics")["dgr_worker_sessions_open"] > 0]
        host = hosts_by_worker[busy[0] if busy else None]
        host.nft("""table inet hole {
            chain i { type filter hook input priority 0; policy drop; iifname "lo" accept; }
            chain o { type filter hook output priority 0; policy drop; oifname "lo" accept; }
        }""")
        hole.update(host=host, start=time.monotonic())
        time.sleep(2)
        host.run("nft", "delete", "table", "inet", "hole")
        hole["end"] = time.monotonic()

    t = threading.Thread(target=black_hole, daemon=True)
    t.start()
    started = time.monotonic()
    times, parts, error = [], [], None
    try:
        for c in chat(swarm, QUESTION, max_tokens, stream=True):
            if c.choices and c.choices[0].delta.content:
                times.append(time.monotonic())
                parts.append(c.choices[0].delta.content)
                if len(parts) == 4:
                    cut.set()
    except openai.APIError as e:
        error = e
    finally:
        ended = time.monotonic()
        cut.set()
        t.join(timeout=15)
        if "host" in hole:
            hole["host"].run("nft", "delete", "table", "inet", "hole", check=False)
    assert "end" in hole, "the black hole was not made and lifted"
    return Holed(parts, times, hole["host"].ns, hole["start"], hole["end"], error, ended - started, ended)


def test_link_black_holed_without_a_replica(swarm: Swarm):
    """Worker B, the only one with the second half, is cut off for 2 s mid-generation: the
    session recovers or fails with a typed error within its deadline, never hanging."""
    want = chat(swarm, QUESTION, 128).choices[0].message.content
    h = stream_across_black_hole(swarm, 128, {f"{swarm.workers[1].host.addr}:{PORT}": swarm.workers[1].host})
    # The gateway's step deadline is 10 s and it replays a failed stage: well within 40 s either way.
    assert h.elapsed < 40, f"the session took {h.elapsed:.1f} s across a 2 s black hole"
    if h.error is not None:
        # A failure is a typed one (the gateway's error event naming the stage), within the
        # gateway's step deadline (10 s) of the cut.
        assert h.error.body and h.error.body.get("code") == "route_failed", f"untyped failure: {h.error!r}"
        assert h.ended - h.start < 12, f"the session failed {h.ended - h.start:.1f} s after the cut"
        print(f"black hole without a replica: failed after {h.elapsed:.1f} s with {h.error.body}")
        return
    assert "".join(h.parts) == want, "the stream across the black hole differs from the undisturbed answer"
    print(f"black hole without a replica: recovered; {len(h.parts)} pieces in {h.elapsed:.1f} s, longest gap {h.stall():.2f} s")


PROMPT = "Repeat exactly: the violet heron counts seventeen lanterns beside the quiet harbour."


def prompt_ids(net) -> list[int]:
    """PROMPT's token ids, less the first and last (they may merge with the chat template's text)."""
    r = subprocess.run([str(DGR), "tokenize", "--text", PROMPT, *net.model()], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    ids = json.loads(r.stdout)["tokens"][1:-1]
    assert len(ids) >= 8, ids
    return ids


def in_clear(streams: dict, gateway: str, ids: list[int]) -> list[str]:
    """Where PROMPT's text or its token ids (packed varints as on the wire, or little-endian
    u32s) cross the capture in clear, off the client's own plain-HTTP hop to `gateway`."""
    text, packed = PROMPT.encode(), varints(ids)
    little = b"".join(i.to_bytes(4, "little") for i in ids)
    hits = []
    for f, data in streams.items():
        src, dst = f"{f[0]}:{f[1]}", f"{f[2]}:{f[3]}"
        if gateway in (src, dst):
            continue
        if text in data:
            hits.append(f"the text, {src} -> {dst}")
        if packed in data or little in data:
            hits.append(f"the token ids, {src} -> {dst}")
    return hits


def test_capture_sees_token_ids_on_plaintext_links(net):
    """The capture's own control: the same request through a swarm whose every process runs
    --insecure-plaintext shows the prompt's token ids on the path, where `in_clear` finds them."""
    h = net.hosts
    tracker = f"{h[6].addr}:7600"
    procs = [net.proc("plain-tracker", 6, ["tracker", "--listen", tracker, "--join-token-file", str(net.token), "--insecure-plaintext"])]
    procs[0].start()
    for i, (a, b) in enumerate(HALVES):
        procs.append(net.proc(f"plain-worker-{i}", 2 + i, [
            "worker", "--layers", f"{a}..{b}", "--threads", "1", "--tracker", tracker, "--join-token-file", str(net.token),
            "--listen", f"{h[2 + i].addr}:7601", "--insecure-plaintext", *net.model(),
        ]))  # fmt: skip
    procs.append(net.proc("plain-gateway", 4, ["gateway", "--tracker", tracker, "--listen", f"{h[4].addr}:8001", "--insecure-plaintext", *net.model()]))
    try:
        for p in procs[1:]:
            p.start()
        plain = openai.OpenAI(base_url=f"http://{h[4].addr}:8001/v1", api_key="none", max_retries=0, timeout=60)
        ask = lambda content: plain.chat.completions.create(  # noqa: E731
            model=procs[-1].ready["models"][0], messages=[{"role": "user", "content": content}], max_tokens=4, temperature=0)

        def routed():
            try:
                return ask(QUESTION)  # not PROMPT: the prefix caches would then hold its first blocks
            except openai.APIError:
                return None

        wait_until("a route through the plaintext swarm", routed, 30, interval=0.2)
        with Capture() as cap:
            ask(PROMPT)
        hits = in_clear(cap.streams(), procs[-1].ready["listening"], prompt_ids(net))
        assert any("token ids" in x for x in hits), f"plaintext links, yet the capture finds no token ids in clear: {hits}"
    finally:
        for p in reversed(procs):
            p.stop()


def test_worker_that_cannot_accept_connections_serves_through_the_relay(net, swarm: Swarm):
    """Worker C's host drops every inbound connection; C (--relay) joins and serves the second half
    through the tracker's relay, and a capture of all traffic on the path holds neither the
    prompt's text nor its token ids outside the client's own plain-HTTP request."""
    h5 = net.hosts[5]
    h5.nft("""table inet inbound {
        chain i { type filter hook input priority 0; policy drop; iifname "lo" accept; ct state established,related accept; }
    }""")
    # The firewall holds: a connection to h5 is not refused, it goes unanswered.
    with pytest.raises(TimeoutError):
        socket.create_connection((h5.addr, 9), timeout=1)

    worker_b = swarm.workers[1]
    worker_b.stop()
    relayed = swarm.worker("worker-c", 5, HALVES[1], "--relay")
    relayed.start()
    assert not {a for a, who in h5.listening() if f"pid={relayed.popen.pid}," in who}, "a --relay worker listens"
    relay_addr = f"relay://{swarm.tracker_addr}/{relayed.ready['worker_id']}"
    want = {f"{net.hosts[2].addr}:{PORT}": HALVES[0], relay_addr: HALVES[1]}
    wait_until("the tracker listing A and the relayed C only", lambda: swarm.workers_listed() == want or None, 30)

    relayed_before = prometheus(f"http://{swarm.tracker_addr}/metrics")["dgr_tracker_relay_sessions_total"]
    with Capture() as cap:
        answer = chat(swarm, PROMPT, 16)
    assert answer.usage.completion_tokens > 0 and answer.choices[0].message.content, answer
    assert prometheus(f"http://{swarm.tracker_addr}/metrics")["dgr_tracker_relay_sessions_total"] > relayed_before
    assert cap.dropped == 0, f"the capture dropped {cap.dropped} frames"

    streams = cap.streams()
    gateway = swarm.gateway.ready["listening"]
    # The control: the client's plain-HTTP request to the gateway shows the prompt in clear.
    assert any(PROMPT.encode() in b for f, b in streams.items() if f"{f[2]}:{f[3]}" == gateway), "the capture missed the client's request"
    relay_bytes = sum(len(b) for f, b in streams.items() if h5.addr in (f[0], f[2]))
    assert relay_bytes > 4096, f"only {relay_bytes} bytes to and from the relayed worker's host were captured"
    hits = in_clear(streams, gateway, prompt_ids(net))
    assert not hits, f"in clear on the path: {hits}"


def test_link_black_holed_with_a_replica_recovers(net, swarm: Swarm):
    """With B back beside the relayed C, the second stage's host (whichever serves the stream) is
    cut off for 2 s mid-generation: the session moves to the other replica and the stream goes
    on exactly as the undisturbed answer, within the deadline."""
    h3 = net.hosts[3]
    b2 = swarm.worker("worker-b2", 3, HALVES[1], "--listen", f"{h3.addr}:{PORT}")
    b2.start()
    wait_until("the tracker listing B again", lambda: len(swarm.workers_listed()) == 3 or None, 30)
    want = chat(swarm, QUESTION, 128).choices[0].message.content
    h = stream_across_black_hole(swarm, 128, {f"{h3.addr}:{PORT}": h3, None: net.hosts[5]})
    assert h.error is None, f"the session failed across a 2 s black hole on {h.host} with a replica to move to: {h.error.body}"
    assert h.elapsed < 40, f"the session took {h.elapsed:.1f} s across a 2 s black hole"
    assert "".join(h.parts) == want, f"the stream across the black hole on {h.host} differs from the undisturbed answer"
    # The hole was mid-generation: the stream stalled while it lasted, and went on.
    assert [t for t in h.times if t > h.start], "no piece arrived after the cut: the hole was not mid-generation"
    print(f"black hole with a replica: recovered from {h.host}; {len(h.parts)} pieces in {h.elapsed:.1f} s, longest gap {h.stall():.2f} s")
