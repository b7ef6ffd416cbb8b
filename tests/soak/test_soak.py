"""The soak: requests at concurrency through a swarm with two replicas of each half of the model,
while it is hurt — a worker SIGKILLed and restarted, another SIGSTOPped and continued, the
tracker SIGKILLed and restarted on its database and port, and ~15% of the clients closing their
stream after a random number of chunks.

What must hold:
- no request is lost or hung: each ends within its deadline, either complete with text identical
  to its fault-free output (computed through the same swarm before any fault, and checked against
  one-process `dgr generate`), or cancelled with what it received a prefix of that output, or with
  a typed OpenAI error (status and error JSON). A request the gateway refused before routing it
  (the tracker down or not yet rejoined: `tracker_unreachable`, `no_route`; every worker full past
  the queue timeout: `workers_full`) is sent again after its Retry-After, as a client should, and
  each refusal is reported;
- every worker's open sessions and KV bytes return to zero within seconds of the last request;
- the ledger (`dgr usage --by key`) holds one request per routed request and its prompt and
  completion totals per key equal the gateway's own per-request sums (its /metrics), which equal
  the sums of the usage each completed request reported to its client; a cancelled request is
  billed at least what its client received and at most its max_tokens.

Size: DGR_SOAK_REQUESTS (default 300) requests at DGR_SOAK_CONCURRENCY (default 16); the request
mix and the fault victims follow DGR_SOAK_SEED (default: random, printed). scripts/soak.sh runs
it; scripts/test-http.sh runs a scaled-down one. The figures go to
$DGR_TEST_ARTIFACTS/soak/result.json and each process's log beside it.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import openai

from soak_swarm import ARTIFACTS, DGR, MODEL, Proc, Swarm, http_get, parse_prometheus

REQUESTS = int(os.environ.get("DGR_SOAK_REQUESTS", "300"))
CONCURRENCY = int(os.environ.get("DGR_SOAK_CONCURRENCY", "16"))
SEED = int(os.environ.get("DGR_SOAK_SEED") or random.SystemRandom().randrange(1 << 31))

# A request must end (complete, cancelled or failed) within this many seconds of being sent
# (including any resending after a refusal); no read (a whole response, or a stream's next chunk)
# may wait longer than READ_TIMEOUT_S. Both are far above what 2 busy cores need.
DEADLINE_S = 120.0
READ_TIMEOUT_S = 60.0
CANCEL_FRACTION = 0.15
WHOLE_FRACTION = 0.20  # non-streamed
# Pre-routing refusals a request may get (each followed by a resend after Retry-After).
MAX_REFUSALS = 20
# Fault times, as fractions of the requests finished.
KILL_WORKER_AT, STOP_WORKER_AT, KILL_TRACKER_AT = 0.2, 0.45, 0.7
KILLED_FOR_S, STOPPED_FOR_S, TRACKER_DOWN_S = 1.5, 2.5, 1.0

KEYS = {
    "reference": "sk-soak-reference-0123456789abcdef01",
    "whole": "sk-soak-whole-0123456789abcdef012345",
    "stream": "sk-soak-stream-0123456789abcdef01234",
    "cancel": "sk-soak-cancel-0123456789abcdef01234",
}

PROMPTS = [
    "Once upon a time, in a village by the sea,",
    "Explain what a hash table is and when to use one.",
    "The three laws of thermodynamics are",
    "Write a short poem about autumn leaves.",
    "def fibonacci(n):",
    "What are the main causes of inflation?",
    "The history of the printing press begins",
    "Give me three tips for learning a new language.",
]


@dataclass(frozen=True)
class Case:
    """One prompt and sampling: a reference output every request of it must reproduce."""

    name: str
    chat: bool
    prompt: str
    max_tokens: int
    temperature: float
    seed: int | None

    def kwargs(self, model: str) -> dict:
        kw = dict(model=model, max_tokens=self.max_tokens, temperature=self.temperature, extra_body={"ignore_eos": True})
        if self.seed is not None:
            kw["seed"] = self.seed
        if self.chat:
            kw["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            kw["prompt"] = self.prompt
        return kw

    def create(self, client: openai.OpenAI, model: str, **extra):
        kw = self.kwargs(model) | extra
        return (client.chat.completions if self.chat else client.completions).create(**kw)

    def generate_args(self) -> list[str]:
        """The same generation by one-process `dgr generate` (the API's sampling defaults)."""
        args = ["generate", "--prompt", self.prompt, "--max-tokens", str(self.max_tokens), "--ignore-eos", "--format", "json"]
        args += ["--threads", "1", "--temperature", str(self.temperature), "--top-k", "0", "--top-p", "1"]
        args += ["--seed", str(self.seed or 0)] + (["--chat"] if self.chat else [])
        return args + (["--model", MODEL] if MODEL else [])


# Prompts alternate between the two endpoints; each is greedy and seeded at temperature 0.8.
CASES = [
    Case(f"{'chat' if i % 2 else 'text'}{i}-{'seeded' if s else 'greedy'}", i % 2 == 1, p, 32 + 8 * ((i + 3 * s) % 5), 0.8 if s else 0.0, 1000 + i if s else None)
    for i, p in enumerate(PROMPTS)
    for s in (0, 1)
]  # fmt: skip


@dataclass
class Ref:
    text: str
    prompt_tokens: int
    completion_tokens: int


@dataclass
class Outcome:
    i: int
    case: str
    mode: str  # whole, stream, cancel
    status: str = "failed"  # completed, cancelled, failed
    text: str = ""
    chunks: int = 0
    cancel_after: int = 0
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    sent_at: float = 0.0  # seconds since the soak began
    elapsed_s: float = 0.0
    max_gap_s: float = 0.0  # the longest wait for a chunk (the first included)
    routed: bool = False  # the gateway routed it (it got a response or a stream)
    error: dict | None = None  # {status, type, code, message, typed}
    refusals: list = field(default_factory=list)  # pre-routing refusals that were resent


def error_of(e: Exception, status: int | None = None) -> dict:
    """An exception as {status, type, code, message, typed}: typed when the gateway said what went
    wrong in OpenAI's error shape."""
    body = getattr(e, "body", None)
    typed = isinstance(body, dict) and isinstance(body.get("message"), str) and isinstance(body.get("type"), str)
    return {
        "status": getattr(e, "status_code", status),
        "type": body.get("type") if typed else type(e).__name__,
        "code": body.get("code") if typed else None,
        "message": body.get("message") if typed else str(e),
        "typed": typed,
    }


class Soak:
    def __init__(self, swarm: Swarm, refs: dict[str, Ref], plan: list[tuple[Case, str, int]]):
        self.swarm = swarm
        self.refs = refs
        self.plan = plan
        self.model = swarm.model_name()
        self.t0 = time.monotonic()
        self.done = 0
        self.cv = threading.Condition()
        self.local = threading.local()
        self.outcomes: list[Outcome | None] = [None] * len(plan)
        self.faults: list[dict] = []
        self.fault_error: BaseException | None = None
        self.finished = False

    def now(self) -> float:
        return time.monotonic() - self.t0

    def client(self, key: str) -> openai.OpenAI:
        clients = self.local.__dict__.setdefault("clients", {})
        if key not in clients:
            clients[key] = openai.OpenAI(base_url=self.swarm.base_url, api_key=KEYS[key], max_retries=0, timeout=READ_TIMEOUT_S)
        return clients[key]

    # One request ------------------------------------------------------------------------------

    def request(self, i: int) -> Outcome:
        case, mode, cancel_after = self.plan[i]
        o = Outcome(i, case.name, mode, cancel_after=cancel_after, sent_at=self.now())
        client = self.client(mode)
        started = time.monotonic()
        while True:
            try:
                self._attempt(client, case, mode, o)
                break
            except openai.APIStatusError as e:
                err = error_of(e)
                if err["code"] in ("tracker_unreachable", "no_route", "workers_full") and len(o.refusals) < MAX_REFUSALS:
                    o.refusals.append({"at": round(self.now(), 3), **err})
                    time.sleep(float(e.response.headers.get("retry-after", "0.5")))
                    continue
                o.error = err
                o.routed = err["code"] == "route_failed"  # the route failed past recovery
                break
            except openai.APIError as e:
                # An error event mid-stream (typed), a timeout or a broken connection (not typed).
                o.error = error_of(e, status=200 if o.routed else None)
                break
            except Exception as e:  # noqa: BLE001 - anything else is a failure to report, not a crash
                o.error = {"status": None, "type": type(e).__name__, "code": None, "message": repr(e), "typed": False}
                break
        o.elapsed_s = time.monotonic() - started
        with self.cv:
            self.outcomes[i] = o
            self.done += 1
            self.cv.notify_all()
        return o

    def _attempt(self, client: openai.OpenAI, case: Case, mode: str, o: Outcome):
        o.text, o.chunks, o.max_gap_s = "", 0, 0.0
        if mode == "whole":
            sent = time.monotonic()
            r = case.create(client, self.model)
            o.routed = True
            o.max_gap_s = time.monotonic() - sent
            c = r.choices[0]
            o.text = (c.message.content if case.chat else c.text) or ""
            o.finish_reason = c.finish_reason
            o.prompt_tokens, o.completion_tokens = r.usage.prompt_tokens, r.usage.completion_tokens
            o.status = "completed"
            return
        last = time.monotonic()
        stream = case.create(client, self.model, stream=True)
        o.routed = True
        try:
            for chunk in stream:
                now = time.monotonic()
                o.max_gap_s = max(o.max_gap_s, now - last)
                last = now
                if chunk.usage is not None:
                    o.prompt_tokens, o.completion_tokens = chunk.usage.prompt_tokens, chunk.usage.completion_tokens
                if not chunk.choices:
                    continue
                c = chunk.choices[0]
                piece = c.delta.content if case.chat else c.text
                if c.finish_reason:
                    o.finish_reason = c.finish_reason
                if piece:
                    o.text += piece
                    o.chunks += 1
                    if mode == "cancel" and o.chunks >= o.cancel_after:
                        o.status = "cancelled"
                        return
            o.status = "completed"
        finally:
            stream.close()  # mid-stream: closes the connection, which cancels the session

    # Faults -----------------------------------------------------------------------------------

    def wait_progress(self, fraction: float) -> bool:
        with self.cv:
            return self.cv.wait_for(lambda: self.finished or self.done >= fraction * len(self.plan))

    def busiest(self, workers: list[Proc], within: float = 3.0) -> tuple[Proc, int]:
        """The worker of `workers` with the most sessions open (waiting briefly for one with any)."""
        deadline = time.monotonic() + within
        while True:
            open_ = [(w, int(w.metrics().get("dgr_worker_sessions_open", 0))) for w in workers]
            w, n = max(open_, key=lambda x: x[1])
            if n > 0 or time.monotonic() > deadline:
                return w, n
            time.sleep(0.05)

    def record(self, **kw):
        kw["at"] = round(kw.get("at", self.now()), 3)
        self.faults.append(kw)
        print(f"soak: fault {kw}", flush=True)

    def faults_thread(self, rng: random.Random):
        try:
            sw = self.swarm
            halves = [[w for w in sw.workers if w.layers == r] for r in sorted({w.layers for w in sw.workers})]
            rng.shuffle(halves)
            kill_half, stop_half = halves[0], halves[1]

            if not self.wait_progress(KILL_WORKER_AT) or self.finished:
                return
            w, n = self.busiest(kill_half)
            at = self.now()
            w.signal(signal.SIGKILL)
            w.popen.wait()
            time.sleep(KILLED_FOR_S)
            w.start()
            restarted = self.now()
            sw.wait_live(len(sw.workers), timeout=15)
            self.record(fault="SIGKILL worker, restarted", worker=w.name, layers=list(w.layers), sessions_open=n, at=at,
                        ready_again_after_s=round(restarted - at, 3), live_again_after_s=round(self.now() - at, 3))  # fmt: skip

            if not self.wait_progress(STOP_WORKER_AT) or self.finished:
                return
            w, n = self.busiest(stop_half)
            at = self.now()
            w.signal(signal.SIGSTOP)
            time.sleep(STOPPED_FOR_S)
            w.signal(signal.SIGCONT)
            self.record(fault="SIGSTOP worker, SIGCONT", worker=w.name, layers=list(w.layers), sessions_open=n, at=at, stopped_for_s=round(self.now() - at, 3))

            if not self.wait_progress(KILL_TRACKER_AT) or self.finished:
                return
            t = sw.tracker
            at = self.now()
            t.signal(signal.SIGKILL)
            t.popen.wait()
            time.sleep(TRACKER_DOWN_S)
            for attempt in range(20):
                try:
                    t.start()
                    break
                except AssertionError:
                    # The port may take a moment to be free again.
                    if attempt == 19:
                        raise
                    time.sleep(0.25)
            back = self.now()
            sw.wait_live(len(sw.workers), timeout=20)
            self.record(fault="SIGKILL tracker, restarted on its db and port", at=at, listening_after_s=round(back - at, 3),
                        all_workers_live_after_s=round(self.now() - at, 3))  # fmt: skip
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.fault_error = e
            print(f"soak: the fault thread failed: {e!r}", flush=True)

    # The run ----------------------------------------------------------------------------------

    def run(self, rng: random.Random) -> float:
        faults = threading.Thread(target=self.faults_thread, args=(rng,), name="faults", daemon=True)
        faults.start()
        pool = ThreadPoolExecutor(max_workers=CONCURRENCY, thread_name_prefix="client")
        futures = [pool.submit(self.request, i) for i in range(len(self.plan))]
        report_every = max(1, len(self.plan) // 10)
        budget = DEADLINE_S * len(self.plan) / CONCURRENCY + 120
        with self.cv:
            last = 0
            while self.done < len(self.plan):
                if not self.cv.wait(timeout=max(0.0, budget - self.now())) and self.now() >= budget:
                    break
                if self.done - last >= report_every:
                    last = self.done
                    print(f"soak: {self.done}/{len(self.plan)} requests done at {self.now():.1f} s", flush=True)
            self.finished = True
            self.cv.notify_all()
        elapsed = self.now()
        faults.join(timeout=60)
        pool.shutdown(wait=False, cancel_futures=True)
        for f in futures:
            if f.done() and f.exception() is not None:
                raise f.exception()
        for c in getattr(self.local, "clients", {}).values():
            c.close()
        return elapsed


# ---------------------------------------------------------------------------------------------


def gateway_tallies(swarm: Swarm) -> dict[str, tuple[int, int, int]]:
    """The gateway's own per-key sums: {key: (requests, prompt tokens, completion tokens)}."""
    m = parse_prometheus(http_get(f"http://{swarm.gateway.addr}/metrics")[1].decode())
    out: dict[str, list[int]] = {}
    for name, col in (("dgr_gateway_requests_total", 0), ("dgr_gateway_prompt_tokens_total", 1), ("dgr_gateway_completion_tokens_total", 2)):
        for sample, v in m.items():
            k = re.match(name + r'\{model="[^"]*",key="([^"]*)"\}$', sample)
            if k:
                out.setdefault(k.group(1), [0, 0, 0])[col] += int(v)
    return {k: tuple(v) for k, v in out.items()}


def gateway_errors(swarm: Swarm) -> dict[str, int]:
    m = parse_prometheus(http_get(f"http://{swarm.gateway.addr}/metrics")[1].decode())
    return {re.search(r'kind="([^"]*)"', s).group(1): int(v) for s, v in m.items() if s.startswith("dgr_gateway_errors_total{")}


def ledger_tallies(swarm: Swarm) -> dict[str, tuple[int, int, int]]:
    return {k: (r["requests"], r["prompt_tokens"], r["completion_tokens"]) for k, r in swarm.usage_by_key().items()}


# The gateway's log line of a recovery (stage and address as Rust's Debug writes an Option).
RECOVERY = re.compile(r"request (\w+) recovered from (\w+) at stage (?:Some\()?(\w+)\)? \((?:Some\(\")?(.*?)(?:\"\))?\) after (\d+) tokens; stall (\d+) ms")


def test_soak_under_faults():
    assert DGR.is_file(), f"{DGR} is missing: build it with `cargo build --release -p dgr`"
    assert REQUESTS >= 10 and CONCURRENCY >= 1, (REQUESTS, CONCURRENCY)
    logdir = ARTIFACTS / "soak"
    shutil.rmtree(logdir, ignore_errors=True)
    logdir.mkdir(parents=True)
    rng = random.Random(SEED)
    print(f"\nsoak: {REQUESTS} requests at concurrency {CONCURRENCY}, seed {SEED} (DGR_SOAK_SEED={SEED} repeats the mix)", flush=True)

    # One-process references for one case of each kind: the swarm's fault-free outputs must equal them.
    checked = [next(c for c in CASES if c.chat == chat and (c.seed is not None) == seeded) for chat in (False, True) for seeded in (False, True)]
    one_process = {}
    for c in checked:
        r = subprocess.run([str(DGR), *c.generate_args()], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, f"dgr {' '.join(c.generate_args())}: {r.stderr}"
        one_process[c.name] = json.loads(r.stdout)

    # A SIGTERM (the CI's timeout) must still stop the swarm.
    def interrupted(*_):
        raise KeyboardInterrupt("SIGTERM")

    previous = signal.signal(signal.SIGTERM, interrupted)
    with tempfile.TemporaryDirectory(prefix="dgr-soak-") as tmp:
        swarm = Swarm(Path(tmp), logdir, KEYS)
        try:
            swarm.start()
            result = soak_on(swarm, rng, one_process)
        finally:
            swarm.stop_all()
            signal.signal(signal.SIGTERM, previous)
    problems = result.pop("problems")
    (logdir / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    print(summary(result), flush=True)
    assert not problems, "the soak found:\n- " + "\n- ".join(problems)


def soak_on(swarm: Swarm, rng: random.Random, one_process: dict) -> dict:
    problems: list[str] = []
    model = swarm.model_name()

    # Fault-free references, through the same swarm, before any fault.
    ref_client = openai.OpenAI(base_url=swarm.base_url, api_key=KEYS["reference"], max_retries=0, timeout=120)
    with ThreadPoolExecutor(max_workers=8) as pool:
        answers = list(pool.map(lambda c: c.create(ref_client, model), CASES))
    ref_client.close()
    refs = {}
    for c, r in zip(CASES, answers):
        ch = r.choices[0]
        refs[c.name] = Ref((ch.message.content if c.chat else ch.text) or "", r.usage.prompt_tokens, r.usage.completion_tokens)
        assert r.usage.completion_tokens == c.max_tokens and ch.finish_reason == "length", f"{c.name}: {r}"
    for name, want in one_process.items():
        if refs[name].text != want["text"] or refs[name].prompt_tokens != len(want["prompt_tokens"]):
            problems.append(f"reference {name}: the swarm's fault-free output differs from one-process dgr generate:\n"
                            f"  swarm:   {refs[name].text!r}\n  generate: {want['text']!r}")  # fmt: skip
    distinct = len({r.text for r in refs.values()})
    assert distinct == len(CASES), f"only {distinct} distinct reference outputs of {len(CASES)} cases"

    # The mix: which case, streamed or not, and where a cancelling client closes its stream.
    plan = []
    for _ in range(REQUESTS):
        case, u = rng.choice(CASES), rng.random()
        mode = "cancel" if u < CANCEL_FRACTION else "whole" if u < CANCEL_FRACTION + WHOLE_FRACTION else "stream"
        plan.append((case, mode, rng.randint(1, case.max_tokens * 3 // 4) if mode == "cancel" else 0))

    soak = Soak(swarm, refs, plan)
    elapsed = soak.run(rng)
    if soak.fault_error is not None:
        problems.append(f"a fault could not be applied: {soak.fault_error!r}")
    if len(soak.faults) != 3:
        problems.append(f"{len(soak.faults)} of 3 faults applied: {soak.faults}")
    for f in soak.faults:
        if "worker" in f and f["sessions_open"] == 0:
            problems.append(f"the fault hit a worker with no session open (nothing to recover): {f}")

    # Every request ended, in time, as it should have.
    outcomes = soak.outcomes
    lost = [i for i, o in enumerate(outcomes) if o is None]
    if lost:
        problems.append(f"{len(lost)} requests never ended within the soak's budget (hung): {lost[:20]}")
    outcomes = [o for o in outcomes if o is not None]
    for o in outcomes:
        case, ref = next(c for c in CASES if c.name == o.case), refs[o.case]
        tag = f"request {o.i} ({o.mode}, {o.case}, sent at {o.sent_at:.1f} s)"
        if o.elapsed_s > DEADLINE_S:
            problems.append(f"{tag} took {o.elapsed_s:.1f} s (deadline {DEADLINE_S} s)")
        if o.status == "completed":
            if o.text != ref.text:
                problems.append(f"{tag}: completed with text different from its reference:\n  got  {o.text!r}\n  want {ref.text!r}")
            if (o.prompt_tokens, o.completion_tokens, o.finish_reason) != (ref.prompt_tokens, case.max_tokens, "length"):
                problems.append(f"{tag}: usage {o.prompt_tokens}+{o.completion_tokens}, finish {o.finish_reason}; want {ref.prompt_tokens}+{case.max_tokens}, length")
        elif o.status == "cancelled":
            if not ref.text.startswith(o.text):
                problems.append(f"{tag}: the text received before cancelling is not a prefix of the reference:\n  got  {o.text!r}\n  want {ref.text!r}")
        elif not o.error or not o.error["typed"]:
            problems.append(f"{tag}: failed without a typed OpenAI error: {o.error}")
        if len(o.refusals) >= MAX_REFUSALS:
            problems.append(f"{tag}: refused {len(o.refusals)} times before routing: {o.refusals[-1]}")
    failed = [o for o in outcomes if o.status == "failed"]
    for o in failed:
        print(f"soak: request {o.i} ({o.mode}, {o.case}) failed after {o.elapsed_s:.1f} s: {o.error}", flush=True)

    # Every process still runs (none crashed), and every worker's sessions and KV are freed.
    for p in [swarm.tracker, *swarm.workers, swarm.gateway]:
        if not p.alive():
            problems.append(f"{p.name} exited ({p.popen.returncode}); its log ends:\n{p.tail(1500)}")
    freed_at, state = None, {}
    t = time.monotonic()
    while time.monotonic() - t < 15:
        try:
            state = {w.name: (int((m := w.metrics())["dgr_worker_sessions_open"]), int(m["dgr_worker_kv_bytes_used"])) for w in swarm.workers if w.alive()}
        except (AssertionError, OSError) as e:
            state = {"error": repr(e)}
        if state and all(v == (0, 0) for v in state.values()):
            freed_at = time.monotonic() - t
            break
        time.sleep(0.1)
    if freed_at is None:
        problems.append(f"15 s after the last request, workers' (sessions_open, kv_bytes_used): {state}")

    # The ledger settles to the gateway's own sums (reports sent during the tracker's restart are
    # retried), and those to what the clients were told.
    settled_at, ledger, gateway = None, {}, {}
    t = time.monotonic()
    while time.monotonic() - t < 30:
        gateway = gateway_tallies(swarm)
        try:
            ledger = ledger_tallies(swarm)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            ledger = {"error": repr(e)}
        if ledger == gateway:
            settled_at = time.monotonic() - t
            break
        time.sleep(0.25)
    if settled_at is None:
        problems.append(f"30 s after the last request the ledger {ledger} differs from the gateway's sums {gateway}")
    expect: dict[str, list[int]] = {k: [0, 0, 0] for k in KEYS}
    expect["reference"] = [len(CASES), sum(r.prompt_tokens for r in refs.values()), sum(r.completion_tokens for r in refs.values())]
    # Completion tokens of requests cancelled or failed: at least what their clients got, at most
    # what they asked for.
    bounds: dict[str, list[int]] = {k: [0, 0] for k in KEYS}
    for o in outcomes:
        if not o.routed:
            continue
        case, ref = next(c for c in CASES if c.name == o.case), refs[o.case]
        e = expect[o.mode]
        e[0] += 1
        e[1] += ref.prompt_tokens
        if o.status == "completed":
            e[2] += o.completion_tokens or 0
        else:
            bounds[o.mode][0] += o.chunks
            bounds[o.mode][1] += case.max_tokens
    for key, (n, prompt, completion) in expect.items():
        got = gateway.get(key, (0, 0, 0))
        if bounds[key][1]:
            lo, hi = completion + bounds[key][0], completion + bounds[key][1]
            if (got[0], got[1]) != (n, prompt) or not lo <= got[2] <= hi:
                problems.append(f"key {key}: the gateway billed {got} (requests, prompt, completion); the clients saw {n} routed requests, "
                                f"{prompt} prompt tokens and between {lo} and {hi} completion tokens")  # fmt: skip
        elif got != (n, prompt, completion):
            problems.append(f"key {key}: the gateway billed {got} (requests, prompt, completion); the clients saw {(n, prompt, completion)}")
    # The workers' own reports (a killed worker's sessions have none) beside the gateway's view.
    try:
        by_worker = swarm.usage_by_worker()
        workers_view = {"disagreements": sum(r["disagreements"] for r in by_worker), "layer_tokens": sum(r["layer_tokens"] for r in by_worker),
                        "requests_per_worker": sum(r["requests"] for r in by_worker)}  # fmt: skip
        workers_view["gateway_layer_tokens"] = sum(r["layer_tokens"] for r in swarm.usage_by_key().values())
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        workers_view = {"error": repr(e)}

    # What the gateway saw: recoveries and their stalls, reports it could not deliver.
    log = swarm.gateway.log.read_text(errors="replace")
    recoveries = [{"kind": m[2], "stage": m[3], "addr": m[4], "at_token": int(m[5]), "stall_ms": int(m[6])} for m in RECOVERY.finditer(log)]
    for line in log.splitlines():
        if "not recorded" in line or "panicked" in line:
            problems.append(f"gateway log: {line}")
    if not recoveries:
        problems.append("no recovery happened: the worker faults hit no running session")

    counts = {s: sum(1 for o in outcomes if o.status == s) for s in ("completed", "cancelled", "failed")}
    lat = sorted(o.elapsed_s for o in outcomes if o.status == "completed")
    refusals = [r | {"request": o.i} for o in outcomes for r in o.refusals]
    return {
        "problems": problems,
        "requests": REQUESTS,
        "concurrency": CONCURRENCY,
        "seed": SEED,
        "elapsed_s": round(elapsed, 1),
        **counts,
        "cancelled_at_chunks": sorted(o.chunks for o in outcomes if o.status == "cancelled"),
        "failures": [{"request": o.i, "mode": o.mode, "case": o.case, **o.error} for o in failed],
        "refusals_resent": refusals,
        "completion_tokens": sum(o.completion_tokens or 0 for o in outcomes if o.status == "completed"),
        "latency_s": {"p50": round(statistics.median(lat), 2), "p99": round(lat[int(0.99 * (len(lat) - 1))], 2), "max": round(lat[-1], 2)} if lat else None,
        "max_client_stall_s": round(max((o.max_gap_s for o in outcomes if o.mode != "whole"), default=0.0), 2),
        "recoveries": recoveries,
        "max_recovery_stall_ms": max((r["stall_ms"] for r in recoveries), default=None),
        "gateway_errors": gateway_errors(swarm),
        "faults": soak.faults,
        "kv_freed_after_s": None if freed_at is None else round(freed_at, 2),
        "ledger_settled_after_s": None if settled_at is None else round(settled_at, 2),
        "ledger": {k: dict(zip(("requests", "prompt_tokens", "completion_tokens"), v)) for k, v in ledger.items()} if "error" not in ledger else ledger,
        "workers_reports": workers_view,
        "outcomes": [asdict(o) for o in outcomes],
    }


def summary(r: dict) -> str:
    kinds: dict[str, int] = {}
    for x in r["recoveries"]:
        kinds[x["kind"]] = kinds.get(x["kind"], 0) + 1
    codes: dict[str, int] = {}
    for x in r["refusals_resent"]:
        codes[x["code"]] = codes.get(x["code"], 0) + 1
    lines = [
        f"soak: {r['requests']} requests at concurrency {r['concurrency']} (seed {r['seed']}) in {r['elapsed_s']} s: "
        f"{r['completed']} completed, {r['cancelled']} cancelled, {r['failed']} failed",
        f"soak: {len(r['recoveries'])} recoveries {kinds}, max recovery stall {r['max_recovery_stall_ms']} ms, max client stall {r['max_client_stall_s']} s, "
        f"latency {r['latency_s']}",
        f"soak: refusals before routing, resent: {codes or 0}; failures: {[(f['status'], f['type'], f['code'], f['message']) for f in r['failures']] or 0}",
        f"soak: KV freed {r['kv_freed_after_s']} s after the last request; ledger settled after {r['ledger_settled_after_s']} s: {r['ledger']}",
    ]  # fmt: skip
    return "\n".join(lines)
