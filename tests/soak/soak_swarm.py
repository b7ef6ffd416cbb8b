"""A swarm assembled by hand so the soak can hurt it: a tracker, four workers (two replicas of
each half of the model's layers, one thread each) and a gateway, each its own process started
from target/release/dgr, with its stdout's JSON ready line read from a file and its stderr kept
under the artifacts directory.

Unlike `dgr up`, which hides its children, every process here can be SIGKILLed, SIGSTOPped,
continued and restarted: a worker with the same --key-file (the same identity to the tracker),
the tracker on the same database and the same port.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DGR = Path(os.environ.get("DGR_BIN", REPO / "target" / "release" / "dgr"))
ARTIFACTS = Path(os.environ.get("DGR_TEST_ARTIFACTS", REPO / "target" / "test-artifacts"))
# None: every command's default (the cached default model).
MODEL = os.environ.get("DGR_MODEL") or None

JOIN_TOKEN = "soak-join-token-0123456789abcdef"
HEARTBEAT_MS = 1000


def http_get(url: str, timeout: float = 5) -> tuple[int, bytes]:
    """GET without raising on 4xx/5xx: (status, body)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def parse_prometheus(text: str) -> dict[str, float]:
    """Samples of a Prometheus text exposition, keyed by name with labels as written."""
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^(\S+?(?:\{.*\})?)\s+(\S+)$", line)
        if m:
            samples[m.group(1)] = float(m.group(2))
    return samples


def run_dgr(*args: str, timeout: float = 30) -> str:
    r = subprocess.run([str(DGR), *args], capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"dgr {' '.join(args)} exited {r.returncode}: {r.stderr.strip()}")
    return r.stdout


@dataclass
class Proc:
    """One dgr process: how to start it again, where its output goes, and its ready line."""

    name: str
    args: list[str]
    env: dict
    workdir: Path
    log: Path
    popen: subprocess.Popen | None = None
    ready: dict = field(default_factory=dict)
    starts: int = 0
    # A worker's layer range.
    layers: tuple = ()

    def spawn(self):
        """Starts the process; `await_ready` then reads its ready line."""
        self.starts += 1
        with open(self.log, "ab") as log:
            log.write(f"--- start {self.starts}: {' '.join(self.args)}\n".encode())
            log.flush()
            out = open(self._out(), "wb")
            self.popen = subprocess.Popen(self.args, env=self.env, cwd=self.workdir, stdin=subprocess.DEVNULL, stdout=out, stderr=log)
            out.close()

    def _out(self) -> Path:
        return self.workdir / f"{self.name}.{self.starts}.out"

    def await_ready(self, timeout: float = 60) -> dict:
        """Waits for the JSON ready line of the last start (the first line of its stdout)."""
        deadline = time.monotonic() + timeout
        while True:
            text = self._out().read_bytes()
            if b"\n" in text:
                self.ready = json.loads(text.split(b"\n", 1)[0])
                return self.ready
            if self.popen.poll() is not None:
                raise AssertionError(f"{self.name} exited ({self.popen.returncode}) before it was ready; its log:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name} printed no ready line within {timeout} s; its log:\n{self.tail()}")
            time.sleep(0.02)

    def start(self, timeout: float = 60) -> dict:
        self.spawn()
        return self.await_ready(timeout)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def addr(self) -> str:
        return self.ready["listening"]

    def signal(self, sig: int):
        self.popen.send_signal(sig)

    def kill(self):
        """SIGKILL and reap (a stopped process dies of SIGKILL too)."""
        if self.popen and self.popen.poll() is None:
            self.popen.kill()
        if self.popen:
            self.popen.wait()

    def stop_gently(self, timeout: float = 10):
        """SIGCONT (it may be stopped), SIGTERM, and SIGKILL if it has not exited in time."""
        if not self.popen or self.popen.poll() is not None:
            return
        try:
            self.popen.send_signal(signal.SIGCONT)
            self.popen.send_signal(signal.SIGTERM)
            self.popen.wait(timeout=timeout)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            self.kill()

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def metrics(self) -> dict[str, float]:
        status, body = http_get(f"http://{self.addr}/metrics")
        if status != 200:
            raise AssertionError(f"GET http://{self.addr}/metrics ({self.name}): {status}")
        return parse_prometheus(body.decode())


class Swarm:
    """A tracker, 2 × 2 workers over layers 0..15 and 15..30, and a gateway, on loopback."""

    def __init__(self, workdir: Path, logdir: Path, api_keys: dict[str, str], layers=((0, 15), (0, 15), (15, 30), (15, 30))):
        self.dir = workdir
        self.logdir = logdir
        self.env = dict(os.environ, DGR_STATE_DIR=str(workdir))
        self.env.pop("DGR_TRACKER", None)
        self.token = workdir / "token"
        self.token.write_text(JOIN_TOKEN + "\n")
        self.keys_file = workdir / "api-keys"
        self.keys_file.write_text("".join(f"{name} {key}\n" for name, key in api_keys.items()))
        self.layers = layers
        self.tracker: Proc | None = None
        self.workers: list[Proc] = []
        self.gateway: Proc | None = None

    def _proc(self, name: str, args: list[str]) -> Proc:
        return Proc(name, [str(DGR), *args], self.env, self.dir, self.logdir / f"{name}.log")

    def _model(self) -> list[str]:
        return ["--model", MODEL] if MODEL else []

    # Starting ---------------------------------------------------------------------------------

    def start(self):
        db = str(self.dir / "tracker.db")
        args = ["tracker", "--listen", "127.0.0.1:0", "--db", db, "--join-token-file", str(self.token), "--heartbeat-ms", str(HEARTBEAT_MS)]
        self.tracker = self._proc("tracker", args)
        self.tracker.start()
        # Later starts reuse the port the first one got.
        self.tracker.args[self.tracker.args.index("127.0.0.1:0")] = self.tracker.addr
        for i, (a, b) in enumerate(self.layers):
            w = self._proc(f"w{i}", [
                "worker", "--layers", f"{a}..{b}", "--threads", "1", "--tracker", self.tracker.addr,
                "--join-token-file", str(self.token), "--key-file", str(self.dir / f"w{i}.key"),
                "--listen", "127.0.0.1:0", "--micro-batches", "2", *self._model(),
            ])  # fmt: skip
            w.layers = (a, b)
            self.workers.append(w)
        # Start every worker before waiting for any: they load at once.
        for w in self.workers:
            w.spawn()
        for w in self.workers:
            w.await_ready()
        self.wait_live(len(self.workers), timeout=30)
        self.gateway = self._proc("gateway", [
            "gateway", "--tracker", self.tracker.addr, "--listen", "127.0.0.1:0", "--join-token-file", str(self.token),
            "--api-keys", str(self.keys_file), *self._model(),
        ])  # fmt: skip
        self.gateway.start()
        deadline = time.monotonic() + 30
        while http_get(f"http://{self.gateway.addr}/health")[0] != 200:
            if time.monotonic() > deadline:
                raise AssertionError(f"the gateway's /health is not 200 within 30 s; its log:\n{self.gateway.tail()}")
            time.sleep(0.05)

    @property
    def base_url(self) -> str:
        return f"http://{self.gateway.addr}/v1"

    def model_name(self) -> str:
        return self.gateway.ready["models"][0]

    # The tracker's view -----------------------------------------------------------------------

    def swarm_workers(self) -> list[dict]:
        v = json.loads(run_dgr("swarm", "--tracker", self.tracker.addr, "--format", "json"))
        return [w for m in v["models"] for w in m["workers"]]

    def live_count(self) -> int:
        try:
            return sum(1 for w in self.swarm_workers() if w.get("live"))
        except (RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError):
            return -1

    def wait_live(self, n: int, timeout: float) -> float:
        """Waits until the tracker lists `n` live workers; returns how long that took."""
        start = time.monotonic()
        while (seen := self.live_count()) != n:
            if time.monotonic() - start > timeout:
                raise AssertionError(f"the tracker lists {seen} live workers, not {n}, after {timeout} s")
            time.sleep(0.1)
        return time.monotonic() - start

    def usage_by_key(self) -> dict[str, dict]:
        rows = json.loads(run_dgr("usage", "--tracker", self.tracker.addr, "--by", "key", "--format", "json"))["rows"]
        return {r["key"]: r for r in rows}

    def usage_by_worker(self) -> list[dict]:
        return json.loads(run_dgr("usage", "--tracker", self.tracker.addr, "--by", "worker", "--format", "json"))["rows"]

    # Stopping ---------------------------------------------------------------------------------

    def stop_all(self):
        for p in [self.gateway, *self.workers, self.tracker]:
            if p is not None:
                p.stop_gently()
