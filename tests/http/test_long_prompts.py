"""Long prompts under `dgr up`'s default flags: a 7,000-token prompt (within SmolLM2's 8,192
context) takes longer to prefill than the step deadline (10 s), yet completes, streamed and not,
with no retry: each prompt chunk that runs through the route restarts the deadline. A worker
stopped (SIGSTOP) during that prefill still fails the request within the step deadline. One
swarm of its own with default limits for the module; each long prefill runs once per mode.
"""

from __future__ import annotations

import os
import re
import signal
import tempfile
import threading
import time
from pathlib import Path

import openai
import pytest

from conftest import descendants, process_name, start_swarm, stop_swarm, wait_until

STEP_DEADLINE_S = 10.0  # dgr up's default --step-timeout
PROMPT_TOKENS = 7000
CONTEXT = 8192
# Numbered sentences: varied enough that the tokenizer cannot merge them away.
SENTENCE = "Note {i}: the river runs past the mill and the bell rings twice."


def long_prompt(client, model: str) -> str:
    """A text of at least PROMPT_TOKENS tokens, as the gateway counts them (a 1-token completion)."""
    per = client.completions.create(model=model, prompt=SENTENCE.format(i=100) + " ", max_tokens=1).usage.prompt_tokens
    # A few sentences over: joined, a sentence may take a token less than alone.
    n = -(-PROMPT_TOKENS // max(per - 1, 1)) + 8
    return " ".join(SENTENCE.format(i=100 + i) for i in range(n))


@pytest.fixture(scope="module")
def defaults():
    """`dgr up` with its default flags (no keys: anonymous requests)."""
    with tempfile.TemporaryDirectory(prefix="dgr-long-") as tmp:
        s = start_swarm(Path(tmp), args=[], log_name="dgr-up-long-prompts.log")
        try:
            yield s
        finally:
            stop_swarm(s)


@pytest.fixture(scope="module")
def prompt(defaults) -> str:
    return long_prompt(defaults.client("none"), defaults.model)


def retries_logged(log: str) -> list[str]:
    return [line for line in log.splitlines() if re.search(r"recovered from|replayed after", line)]


def test_a_7000_token_prompt_completes_without_a_retry(defaults, prompt):
    client = defaults.client("none", timeout=300)
    before = len(defaults.log.read_text())
    started = time.monotonic()
    r = client.completions.create(model=defaults.model, prompt=prompt, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    took = time.monotonic() - started
    assert PROMPT_TOKENS <= r.usage.prompt_tokens <= CONTEXT - 16, f"the prompt is {r.usage.prompt_tokens} tokens"
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length", r
    print(f"{r.usage.prompt_tokens}-token prompt, 16 tokens: {took:.1f} s")
    assert not retries_logged(defaults.log.read_text()[before:]), "a retry was logged for a slow but live route"


def test_a_7000_token_prompt_streams_without_a_retry(defaults, prompt):
    client = defaults.client("none", timeout=300)
    before = len(defaults.log.read_text())
    stream = client.completions.create(
        model=defaults.model,
        prompt=prompt,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    texts = [c.choices[0].text for c in chunks if c.choices]
    usage = [c.usage for c in chunks if c.usage]
    assert usage and usage[-1].completion_tokens == 16 and usage[-1].prompt_tokens >= PROMPT_TOKENS, usage
    assert "".join(texts), "the stream carried no text"
    assert not retries_logged(defaults.log.read_text()[before:]), "a retry was logged for a slow but live route"


def test_a_prompt_over_the_context_is_400(defaults, prompt):
    client = defaults.client("none")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=defaults.model, prompt=prompt + " " + prompt, max_tokens=16)
    assert e.value.code == "context_length_exceeded", e.value.body


def worker_pids(swarm) -> dict[int, int]:
    """dgr up's worker processes by the end of their layer range."""
    out = {}
    for pid in descendants(swarm.proc.pid):
        m = re.search(r"\bworker\b.*--layers (\d+)\.\.(\d+)", process_name(pid))
        if m:
            out[int(m.group(2))] = pid
    assert len(out) == 2, f"expected dgr up's two workers, found {out}"
    return out


def test_a_worker_stopped_mid_prefill_fails_the_request_within_the_step_deadline(defaults, prompt):
    client = defaults.client("none", timeout=300)
    last_stage = worker_pids(defaults)[max(worker_pids(defaults))]
    addr = next(w["addr"] for w in defaults.workers() if w["layers"][1] == max(worker_pids(defaults)))
    prefilled = lambda: defaults.worker_metrics()[addr]["dgr_worker_tokens_prefilled_total"]
    start = prefilled()
    result = {}

    def ask():
        try:
            result["ok"] = client.completions.create(model=defaults.model, prompt=prompt, max_tokens=16, temperature=0)
        except openai.APIStatusError as e:
            result["error"] = e
        result["at"] = time.monotonic()

    t = threading.Thread(target=ask)
    t.start()
    try:
        # Stopped in the middle of the prefill: the last stage has computed some chunks, not all.
        wait_until("the last stage to compute a prompt chunk", lambda: prefilled() > start, timeout=60, interval=0.1)
        os.kill(last_stage, signal.SIGSTOP)
        stopped = time.monotonic()
        t.join(timeout=STEP_DEADLINE_S + 10)
        assert not t.is_alive(), f"no answer {STEP_DEADLINE_S + 10} s after the worker was stopped"
    finally:
        os.kill(last_stage, signal.SIGCONT)
        t.join()
    took = result["at"] - stopped
    print(f"stopped the last stage mid-prefill: answered {took:.1f} s later: {result}")
    # One replica: no route avoids the stopped worker, so the request fails, naming the stage.
    e = result.get("error")
    assert e is not None and e.status_code == 502, f"expected a 502 naming the stopped stage, got {result}"
    assert "silent" in str(e) and "stage 1" in str(e), e
    assert took <= STEP_DEADLINE_S + 2, f"failed {took:.1f} s after the stop, past the step deadline"
    log = defaults.log.read_text()
    assert not re.search(r"recovered from", log), "a request that failed was logged as recovered"
    assert not re.search(r"stall -|stage \?", log), "a log line with a negative stall or an unnamed stage"
