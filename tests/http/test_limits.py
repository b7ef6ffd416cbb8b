"""Refusals: API keys, request limits and quotas return their 4xx through the official client,
and none of them reaches a worker (each worker's sessions_opened_total is unchanged)."""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit

import openai
import pytest

from conftest import KEYS, MAX_BODY_BYTES, MAX_PROMPT_TOKENS, MAX_TOKENS_LIMIT, SMALL_QUOTA, wait_until


def test_a_bad_key_is_refused_with_401(swarm, no_worker_touched):
    bad = swarm.client("sk-not-a-key-of-this-swarm-0000")
    with no_worker_touched(), pytest.raises(openai.AuthenticationError) as e:
        bad.completions.create(model=swarm.model, prompt="Hello", max_tokens=4)
    assert e.value.status_code == 401, e.value
    assert e.value.code == "invalid_api_key", e.value.body


def test_no_key_is_refused_with_401_once_keys_exist(swarm, no_worker_touched):
    client = swarm.client("unused")
    no_key = {"Authorization": openai.Omit()}  # the client sends no Authorization header at all
    for stream in (False, True):
        with no_worker_touched(), pytest.raises(openai.AuthenticationError) as e:
            client.chat.completions.create(
                model=swarm.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=stream, extra_headers=no_key
            )
        assert e.value.status_code == 401, e.value
        assert e.value.response.request.headers.get("authorization") is None, "the request did carry a key"


OVERSIZED = {
    "max_tokens over the limit": (dict(prompt="Hello", max_tokens=MAX_TOKENS_LIMIT + 1), "max_tokens"),
    "prompt over --max-prompt-tokens": (dict(prompt="hello " * (MAX_PROMPT_TOKENS + 50), max_tokens=4), "context_length_exceeded"),
    "n = 2": (dict(prompt="Hello", max_tokens=4, n=2), "n"),
    "an unknown parameter": (dict(prompt="Hello", max_tokens=4, extra_body={"frobnicate": True}), "frobnicate"),
    "an unknown parameter, streamed": (dict(prompt="Hello", max_tokens=4, stream=True, extra_body={"frobnicate": True}), "frobnicate"),
}


@pytest.mark.parametrize("case", OVERSIZED)
def test_oversized_or_unsupported_requests_are_400(swarm, client, no_worker_touched, case):
    kw, names = OVERSIZED[case]
    with no_worker_touched(), pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=swarm.model, **kw)
    err = e.value.body if isinstance(e.value.body, dict) else {}
    said = f"{err.get('param')} {err.get('code')} {err.get('message')}"
    assert names in said, f"{case}: the 400 does not name {names!r}: {e.value.body}"


def test_chat_prompt_over_the_limit_is_400(swarm, client, no_worker_touched):
    long = [{"role": "user", "content": "hello " * (MAX_PROMPT_TOKENS + 50)}]
    with no_worker_touched(), pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=swarm.model, messages=long, max_tokens=4)
    assert e.value.code == "context_length_exceeded", e.value.body


def test_an_unknown_model_is_404(swarm, client, no_worker_touched):
    with no_worker_touched(), pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="Hello", max_tokens=4)
    assert e.value.code == "model_not_found", e.value.body


def test_a_body_over_the_size_limit_is_413(swarm, no_worker_touched):
    url = urlsplit(swarm.base_url)
    body = json.dumps({"model": swarm.model, "prompt": "x" * (2 * MAX_BODY_BYTES), "max_tokens": 4}).encode()
    with no_worker_touched():
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
        try:
            headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEYS['free'][0]}"}
            conn.request("POST", url.path + "/completions", body=body, headers=headers)
            r = conn.getresponse()
            status, payload = r.status, r.read()
        finally:
            conn.close()
    assert status == 413, f"a {len(body)}-byte body (limit {MAX_BODY_BYTES}): HTTP {status} {payload[:300]!r}"
    assert json.loads(payload)["error"]["code"] == "body_too_large", payload


def test_a_key_over_its_quota_gets_429_with_retry_after(swarm, no_worker_touched):
    # A route reserves its whole budget (prompt + max_tokens) against the quota: the first
    # request asks for exactly what is left after its prompt, and uses it all.
    prompt = swarm.client("free").completions.create(model=swarm.model, prompt="Hello", max_tokens=1).usage.prompt_tokens
    small = swarm.client("small")
    r = small.completions.create(
        model=swarm.model, prompt="Hello", max_tokens=SMALL_QUOTA - prompt, temperature=0, extra_body={"ignore_eos": True}
    )
    used = r.usage.total_tokens
    assert used == SMALL_QUOTA, f"the first request should use the whole quota of {SMALL_QUOTA}: {r.usage}"
    # The gateway reports usage to the ledger once the response is out: wait for it there.
    wait_until(
        "the ledger to bill the small key",
        lambda: (row := swarm.usage().get("small")) and row["prompt_tokens"] + row["completion_tokens"] >= used,
        timeout=5,
        interval=0.1,
    )
    for stream in (False, True):
        with no_worker_touched(), pytest.raises(openai.RateLimitError) as e:
            small.completions.create(model=swarm.model, prompt="Hello", max_tokens=4, stream=stream)
        assert e.value.status_code == 429, e.value
        retry_after = e.value.response.headers.get("retry-after")
        assert retry_after is not None and retry_after.isdigit() and int(retry_after) > 0, f"Retry-After: {retry_after!r}"
        assert e.value.code == "insufficient_quota", e.value.body
    # Other keys are not limited by it.
    ok = swarm.client("free").completions.create(model=swarm.model, prompt="Hello", max_tokens=2)
    assert ok.usage.completion_tokens >= 1, ok


def test_a_slow_client_is_cut_off_and_the_gateway_keeps_serving(swarm, client, no_worker_touched):
    """Slow-loris: a request head that never ends is dropped within the head deadline (10 s)."""
    import socket
    import time
    from urllib.parse import urlparse

    root = urlparse(swarm.root)
    s = socket.create_connection((root.hostname, root.port), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and then nothing more
    started = time.monotonic()
    try:
        s.recv(1024)  # an answer (408) or the close
    except OSError:
        pass
    waited = time.monotonic() - started
    s.close()
    assert waited < 15, f"a stalled request head held its connection for {waited:.1f} s"
    models = client.models.list()
    assert models.data, "the gateway still serves"
