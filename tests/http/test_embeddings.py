"""/v1/embeddings through the official client against the session's `dgr up`: a string's vector
equals `dgr embed`'s one-process vector (cosine within 1e-5), 32 inputs in one call come back in
order and each equals its single-input vector, more inputs than the workers have sessions all
come back, base64 decodes to the same floats, the usage is counted, and bad inputs get 400s
without reaching a worker."""

from __future__ import annotations

import base64
import json
import math
import os
import struct

import openai
import pytest

from conftest import MAX_PROMPT_TOKENS, run_dgr


def cosine(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), f"{len(a)} values vs {len(b)}"
    dot = sum(x * y for x, y in zip(a, b))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def one_process(text: str) -> list[float]:
    out = json.loads(run_dgr("embed", "--text", text, *(["--model", os.environ["DGR_MODEL"]] if "DGR_MODEL" in os.environ else [])))
    return out["embedding"]


def test_an_embedding_equals_the_one_process_vector(swarm, client):
    text = "The capital of France is Paris, and its river is the Seine."
    r = client.embeddings.create(model=swarm.model, input=text, encoding_format="float")
    assert r.object == "list" and r.model == swarm.model and len(r.data) == 1
    got = r.data[0].embedding
    assert r.data[0].index == 0 and r.data[0].object == "embedding"
    want = one_process(text)
    c = cosine(got, want)
    print(f"cosine to dgr embed: {c:.9f}; {len(got)} values; max |Δ| {max(abs(x - y) for x, y in zip(got, want)):.3g}")
    assert abs(1 - c) <= 1e-5, f"cosine {c}"
    assert abs(math.sqrt(sum(x * x for x in got)) - 1) < 1e-5, "not L2-normalised"
    assert r.usage.prompt_tokens == r.usage.total_tokens > 0


def test_a_batch_of_32_comes_back_in_order_each_as_it_is_alone(swarm, client):
    texts = [f"Sentence number {i}: {'a fox ' * (i % 5)}jumps over {i} lazy dogs." for i in range(32)]
    before = swarm.gateway_metrics()
    r = client.embeddings.create(model=swarm.model, input=texts, encoding_format="float")
    assert [d.index for d in r.data] == list(range(32))
    singles = [client.embeddings.create(model=swarm.model, input=t, encoding_format="float") for t in texts]
    for i, (d, s) in enumerate(zip(r.data, singles)):
        assert d.embedding == s.data[0].embedding, f"input {i} in the batch differs from its single-input vector"
    assert r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    # Distinct inputs, distinct vectors.
    assert len({tuple(d.embedding) for d in r.data}) == 32
    after = swarm.gateway_metrics()
    key = f'dgr_gateway_embedding_inputs_total{{model="{swarm.model}"}}'
    assert after[key] - before.get(key, 0) == 32 + 32, f"{key}: {before.get(key)} → {after[key]}"
    tokens = f'dgr_gateway_embedding_tokens_total{{model="{swarm.model}"}}'
    assert after[tokens] - before.get(tokens, 0) == 2 * r.usage.prompt_tokens


def test_more_inputs_than_the_workers_have_sessions_all_come_back(swarm, client):
    # 256 inputs against workers of 64 sessions each: the ones past the room wait for it (the
    # tracker answers "full", the gateway asks again) rather than failing.
    texts = [f"input {i} of a long batch" for i in range(256)]
    r = client.embeddings.create(model=swarm.model, input=texts, encoding_format="float")
    assert [d.index for d in r.data] == list(range(256))
    assert len({tuple(d.embedding) for d in r.data}) == 256


def test_base64_decodes_to_the_same_floats(swarm, client):
    text = "base64 or floats, the same vector"
    floats = client.embeddings.create(model=swarm.model, input=text, encoding_format="float").data[0].embedding
    # The client's default is base64, which it decodes itself ...
    decoded_by_client = client.embeddings.create(model=swarm.model, input=text).data[0].embedding
    assert decoded_by_client == floats
    # ... and the raw body decodes as little-endian f32.
    raw = client.embeddings.with_raw_response.create(model=swarm.model, input=text, encoding_format="base64")
    b64 = json.loads(raw.http_response.text)["data"][0]["embedding"]
    values = list(struct.unpack(f"<{len(floats)}f", base64.b64decode(b64)))
    assert values == floats


def test_token_inputs_embed_as_their_text_does(swarm, client):
    text = "tokens or text"
    tokens = json.loads(run_dgr("embed", "--text", text, *(["--model", os.environ["DGR_MODEL"]] if "DGR_MODEL" in os.environ else [])))[
        "tokens"
    ]
    by_text = client.embeddings.create(model=swarm.model, input=text, encoding_format="float").data[0].embedding
    by_ids = client.embeddings.create(model=swarm.model, input=tokens, encoding_format="float").data[0].embedding
    lists = client.embeddings.create(model=swarm.model, input=[tokens, tokens[:3]], encoding_format="float")
    assert by_ids == by_text and lists.data[0].embedding == by_text
    assert [d.index for d in lists.data] == [0, 1]


BAD = {
    "an empty list": (dict(input=[]), "input"),
    "an empty string": (dict(input=""), "input"),
    "an empty token list": (dict(input=[[1, 2], []]), "input"),
    "a token outside the vocabulary": (dict(input=[1, 10_000_000]), "vocabulary"),
    "an input over the prompt limit": (dict(input="hello " * (MAX_PROMPT_TOKENS + 50)), "context_length_exceeded"),
    "too many inputs": (dict(input=["a"] * 2049), "2048"),
    "other dimensions": (dict(input="x", dimensions=7), "dimensions"),
    "an unknown encoding": (dict(input="x", encoding_format="int8"), "encoding_format"),
    "an unknown parameter": (dict(input="x", extra_body={"frobnicate": True}), "frobnicate"),
    "mixed input types": (dict(input=[1, "a"]), "input"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_inputs_are_400s(swarm, client, no_worker_touched, case):
    kw, names = BAD[case]
    with no_worker_touched(), pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=swarm.model, **{"encoding_format": "float", **kw})
    err = e.value.body if isinstance(e.value.body, dict) else {}
    said = f"{err.get('param')} {err.get('code')} {err.get('message')}"
    assert names in said, f"{case}: the 400 does not name {names!r}: {e.value.body}"


def test_an_unknown_model_is_404(swarm, client):
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="x")
