"""Hosts in network namespaces: dgr's processes on different addresses of one bridged network.

scripts/test-netns.sh builds the namespaces (scripts/netns.sh: a hub namespace holding a bridge at
10.77.0.100, where this suite runs, and hosts PREFIX-h1 .. PREFIX-h6 at 10.77.0.1 .. 10.77.0.6)
and runs pytest inside the hub. Each dgr process is started in its host's namespace with
`ip netns exec`, its stdout's JSON ready line read from a file and its stderr kept under the
artifacts directory.

Environment: DGR_NETNS_PREFIX (the namespaces' prefix), DGR_BIN (default: target/release/dgr),
DGR_MODEL (default: dgr's default model), DGR_TEST_ARTIFACTS (default: target/test-artifacts).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DGR = Path(os.environ.get("DGR_BIN", REPO / "target" / "release" / "dgr"))
ARTIFACTS = Path(os.environ.get("DGR_TEST_ARTIFACTS", REPO / "target" / "test-artifacts")) / "netns"
MODEL = os.environ.get("DGR_MODEL") or None
PREFIX = os.environ.get("DGR_NETNS_PREFIX", "")

JOIN_TOKEN = "netns-join-token-0123456789abcdef"
API_KEY = "sk-netns-0123456789abcdef0123456789"
# SmolLM2-135M has 30 layers: worker A serves the first half, worker B (or the relayed C) the rest.
HALVES = ((0, 15), (15, 30))
PORT = 7500


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A skipped test is a failed one: missing root, `ip`, `nft` or a model must not pass quietly."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"skipped, which this suite counts as a failure: {report.longrepr}"


def wait_until(what: str, check, timeout: float, interval: float = 0.05):
    """Polls `check()` until it returns something truthy; fails naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        last = check()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what} (last seen: {last!r})")
        time.sleep(interval)


def http_get(url: str, timeout: float = 5) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def prometheus(url: str) -> dict[str, float]:
    status, body = http_get(url)
    assert status == 200, f"GET {url}: {status}"
    samples = {}
    for line in body.decode().splitlines():
        m = re.match(r"^([^#\s]\S*?(?:\{.*\})?)\s+(\S+)$", line)
        if m:
            samples[m.group(1)] = float(m.group(2))
    return samples


@dataclass
class Host:
    """One namespace host: its namespace and its address on the bridge."""

    ns: str
    addr: str

    def run(self, *cmd: str, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess:
        r = subprocess.run(["ip", "netns", "exec", self.ns, *cmd], capture_output=True, text=True, timeout=timeout)
        assert not check or r.returncode == 0, f"{' '.join(cmd)} in {self.ns} exited {r.returncode}: {r.stderr.strip()}"
        return r

    def listening(self) -> set[tuple[str, str]]:
        """Every listening TCP socket and bound UDP socket in this namespace: (local address, process)."""
        out = set()
        for line in self.run("ss", "-H", "-ltunp").stdout.splitlines():
            cols = line.split()
            # Netid State Recv-Q Send-Q Local:Port Peer:Port [users:(("name",pid=N,fd=M))]
            out.add((cols[4], cols[6] if len(cols) > 6 else "?"))
        return out

    def nft(self, script: str):
        """Loads an nftables script into this namespace's ruleset."""
        r = subprocess.run(["ip", "netns", "exec", self.ns, "nft", "-f", "-"], input=script, capture_output=True, text=True, timeout=10)
        assert r.returncode == 0, f"nft in {self.ns} exited {r.returncode}: {r.stderr.strip()}\n{script}"


@dataclass
class Proc:
    """One dgr process in a namespace, with its ready line."""

    name: str
    host: Host
    args: list[str]
    env: dict
    workdir: Path
    popen: subprocess.Popen | None = None
    ready: dict = field(default_factory=dict)

    @property
    def log(self) -> Path:
        return ARTIFACTS / f"{self.name}.log"

    def spawn(self):
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        out = self.workdir / f"{self.name}.out"
        with open(self.log, "wb") as log, open(out, "wb") as o:
            log.write(f"--- in {self.host.ns} ({self.host.addr}): {' '.join(self.args)}\n".encode())
            log.flush()
            # `ip netns exec` execs dgr in place: the pid is dgr's.
            cmd = ["ip", "netns", "exec", self.host.ns, str(DGR), *self.args]
            self.popen = subprocess.Popen(cmd, env=self.env, cwd=self.workdir, stdin=subprocess.DEVNULL, stdout=o, stderr=log)

    def await_ready(self, timeout: float = 60) -> dict:
        out = self.workdir / f"{self.name}.out"

        def line():
            text = out.read_bytes()
            if b"\n" in text:
                return text.split(b"\n", 1)[0]
            assert self.popen.poll() is None, f"{self.name} exited ({self.popen.returncode}) before it was ready:\n{self.tail()}"
            return None

        self.ready = json.loads(wait_until(f"{self.name}'s ready line", line, timeout))
        return self.ready

    def start(self, timeout: float = 60) -> dict:
        self.spawn()
        return self.await_ready(timeout)

    def stop(self, timeout: float = 15):
        """SIGTERM, then SIGKILL if it has not exited in time."""
        if self.popen is None or self.popen.poll() is not None:
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:]


class Net:
    """The namespace hosts and every dgr process started on them (all stopped at the end)."""

    def __init__(self, workdir: Path):
        assert PREFIX, "DGR_NETNS_PREFIX is unset: run the suite through scripts/test-netns.sh"
        assert os.geteuid() == 0, "the namespace suite needs root"
        assert DGR.is_file(), f"{DGR} is missing: build it with `cargo build --release -p dgr`"
        self.dir = workdir
        self.hosts = {i: Host(f"{PREFIX}-h{i}", f"10.77.0.{i}") for i in range(1, 7)}
        self.procs: list[Proc] = []
        self.token = workdir / "join-token"
        self.token.write_text(JOIN_TOKEN + "\n")
        self.env = dict(os.environ)
        for var in ("DGR_TRACKER", "DGR_TRACKER_KEY"):
            self.env.pop(var, None)

    def proc(self, name: str, host: int, args: list[str], env: dict | None = None) -> Proc:
        """A dgr process on host `host` with its own state directory."""
        state = self.dir / name
        state.mkdir(exist_ok=True)
        p = Proc(name, self.hosts[host], args, dict(env or self.env, DGR_STATE_DIR=str(state)), state)
        self.procs.append(p)
        return p

    def model(self) -> list[str]:
        return ["--model", MODEL] if MODEL else []

    def stop_all(self):
        for p in reversed(self.procs):
            p.stop()


@pytest.fixture(scope="session")
def net():
    with tempfile.TemporaryDirectory(prefix="dgr-netns-") as tmp:
        n = Net(Path(tmp))
        try:
            yield n
        finally:
            n.stop_all()


@dataclass
class Swarm:
    """Tracker on h1 (0.0.0.0), worker A on h2 and B on h3 (each half the layers), the gateway on h4."""

    net: Net
    tracker: Proc
    workers: list[Proc]
    gateway: Proc
    env: dict

    @property
    def tracker_addr(self) -> str:
        """The tracker listens on all of h1's interfaces; the others reach it at h1's address."""
        return f"{self.tracker.host.addr}:7400"

    @property
    def base_url(self) -> str:
        return f"http://{self.gateway.ready['listening']}/v1"

    def swarm_json(self) -> dict:
        r = subprocess.run([str(DGR), "swarm", "--tracker", self.tracker_addr, "--format", "json"],
                           env=self.env, capture_output=True, text=True, timeout=30)  # fmt: skip
        assert r.returncode == 0, f"dgr swarm exited {r.returncode}: {r.stderr.strip()}"
        return json.loads(r.stdout)

    def workers_listed(self) -> dict[str, tuple]:
        """The tracker's workers of the one served model: {address: (first layer, end)}."""
        models = self.swarm_json()["models"]
        return {w["addr"]: tuple(w["layers"]) for m in models for w in m["workers"]}

    def worker(self, name: str, host: int, layers: tuple[int, int], *flags: str) -> Proc:
        a, b = layers
        return self.net.proc(name, host, [
            "worker", "--layers", f"{a}..{b}", "--threads", "1", "--tracker", self.tracker_addr,
            "--join-token-file", str(self.net.token), *flags, *self.net.model(),
        ], self.env)  # fmt: skip


@pytest.fixture(scope="session")
def swarm(net: Net) -> Swarm:
    h = net.hosts
    # On 0.0.0.0 without --advertise, as one would on a host with several addresses: a relayed
    # worker is then named by the address it reached.
    tracker = net.proc("tracker", 1, ["tracker", "--listen", "0.0.0.0:7400", "--join-token-file", str(net.token)])
    tracker.start()
    # Everyone pins the tracker's key from its ready line rather than trusting it on first use.
    env = dict(net.env, DGR_TRACKER_KEY=tracker.ready["link_key"])
    s = Swarm(net, tracker, [], None, env)
    for i, layers in enumerate(HALVES):
        host = 2 + i
        s.workers.append(s.worker(f"worker-{'ab'[i]}", host, layers, "--listen", f"{h[host].addr}:{PORT}"))
    for w in s.workers:
        w.spawn()
    for w in s.workers:
        w.await_ready()
    want = {f"{h[2].addr}:{PORT}": HALVES[0], f"{h[3].addr}:{PORT}": HALVES[1]}
    wait_until("both workers listed by the tracker", lambda: s.workers_listed() == want or None, 30)
    keys = net.dir / "api-keys"
    keys.write_text(f"netns {API_KEY}\n")
    s.gateway = net.proc("gateway", 4, [
        "gateway", "--tracker", s.tracker_addr, "--listen", f"{h[4].addr}:8000", "--api-keys", str(keys),
        "--join-token-file", str(net.token), *net.model(),
    ], env)  # fmt: skip
    s.gateway.start()
    return s
