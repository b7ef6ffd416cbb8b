"""The OpenAI API through the official client: models, completions and chat completions
(streamed or not) with usage, logprobs, seeded sampling, stop strings, and greedy output that
equals one-process `dgr generate` token for token."""

from __future__ import annotations

import json
import math

from conftest import run_dgr

PROMPT = "Once upon a time"
CHAT = [{"role": "user", "content": "Name three colours."}]


def assert_usage(usage, what: str, completion_max: int | None = None):
    assert usage is not None, f"{what}: no usage"
    assert usage.prompt_tokens > 0, f"{what}: usage.prompt_tokens = {usage.prompt_tokens}"
    assert usage.completion_tokens > 0, f"{what}: usage.completion_tokens = {usage.completion_tokens}"
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens, f"{what}: {usage}"
    if completion_max is not None:
        assert usage.completion_tokens <= completion_max, f"{what}: {usage.completion_tokens} > max_tokens {completion_max}"


def counts(usage):
    """The token counts of a usage (its cached tokens differ once an earlier request filled the cache)."""
    return (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens)


def test_models_list_has_the_served_model(swarm, client):
    ids = [m.id for m in client.models.list()]
    assert swarm.model in ids, f"{swarm.model!r} not in /v1/models: {ids}"


def test_completion_has_text_and_usage(swarm, client):
    r = client.completions.create(model=swarm.model, prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.object == "text_completion", r
    assert len(r.choices) == 1, r.choices
    c = r.choices[0]
    assert c.text, f"empty completion: {r}"
    assert c.finish_reason in ("length", "stop"), c.finish_reason
    assert_usage(r.usage, "completion", 12)
    if c.finish_reason == "length":
        assert r.usage.completion_tokens == 12, r.usage


def test_chat_completion_has_a_message_and_usage(swarm, client):
    r = client.chat.completions.create(model=swarm.model, messages=CHAT, max_tokens=16, temperature=0)
    assert r.object == "chat.completion", r
    m = r.choices[0].message
    assert m.role == "assistant", m
    assert m.content, f"empty chat answer: {r}"
    assert r.choices[0].finish_reason in ("length", "stop"), r.choices[0].finish_reason
    assert_usage(r.usage, "chat completion", 16)


def test_streamed_completion_equals_the_whole_one_and_ends_with_usage(swarm, client):
    whole = client.completions.create(model=swarm.model, prompt=PROMPT, max_tokens=16, temperature=0)
    chunks = list(
        client.completions.create(
            model=swarm.model, prompt=PROMPT, max_tokens=16, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    assert len(chunks) >= 2, f"a stream of {len(chunks)} chunk(s)"
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == whole.choices[0].text, f"streamed {text!r} != whole {whole.choices[0].text!r}"
    last = chunks[-1]
    assert last.usage is not None, f"the last chunk has no usage: {last}"
    assert last.choices == [], f"the usage chunk has choices: {last.choices}"
    assert_usage(last.usage, "stream's last chunk", 16)
    assert counts(last.usage) == counts(whole.usage), f"stream usage {last.usage} != whole usage {whole.usage}"
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason], f"finish reasons in the stream: {finishes}"


def test_streamed_chat_equals_the_whole_one_and_ends_with_usage(swarm, client):
    whole = client.chat.completions.create(model=swarm.model, messages=CHAT, max_tokens=16, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=swarm.model, messages=CHAT, max_tokens=16, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant", f"first chunk: {chunks[0]}"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content, f"streamed {text!r} != whole {whole.choices[0].message.content!r}"
    last = chunks[-1]
    assert last.usage is not None and last.choices == [], f"the last chunk is not a usage chunk: {last}"
    assert counts(last.usage) == counts(whole.usage), f"stream usage {last.usage} != whole usage {whole.usage}"


def test_completion_logprobs_shapes_and_chosen_token_among_the_top(swarm, client):
    r = client.completions.create(model=swarm.model, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert lp is not None, "no logprobs"
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n, (
        f"lengths: tokens {len(lp.tokens)}, token_logprobs {len(lp.token_logprobs)}, top_logprobs {len(lp.top_logprobs)}, "
        f"text_offset {len(lp.text_offset)}, completion tokens {n}"
    )
    assert "".join(lp.tokens) == r.choices[0].text, f"tokens {lp.tokens} do not spell the text {r.choices[0].text!r}"
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset), lp.text_offset
    for i, (token, logprob, top) in enumerate(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)):
        assert logprob <= 0 and math.isfinite(logprob), f"token {i}: logprob {logprob}"
        assert 1 <= len(top) <= 2, f"token {i}: {len(top)} alternatives for logprobs=2: {top}"
        # Greedy: the chosen token is the most likely one.
        assert top.get(token) == logprob, f"token {i} {token!r} ({logprob}) is not among the top: {top}"
        assert logprob == max(top.values()), f"token {i}: chosen {logprob} < best {max(top.values())}"


def test_chat_logprobs_shapes_and_chosen_token_among_the_top(swarm, client):
    r = client.chat.completions.create(
        model=swarm.model, messages=CHAT, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens, f"{len(content)} entries for {r.usage.completion_tokens} tokens"
    assert "".join(e.token for e in content) == r.choices[0].message.content, "the tokens do not spell the answer"
    for i, e in enumerate(content):
        assert e.logprob <= 0, f"token {i}: logprob {e.logprob}"
        assert bytes(e.bytes) == e.token.encode(), f"token {i}: bytes {e.bytes} != {e.token!r}"
        assert len(e.top_logprobs) == 3, f"token {i}: {len(e.top_logprobs)} alternatives for top_logprobs=3"
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True), f"token {i}: alternatives not most likely first: {tops}"
        assert (e.token, e.logprob) in [(t.token, t.logprob) for t in e.top_logprobs], f"token {i}: {e} not among its top"
        assert e.logprob == tops[0], f"token {i}: greedy chose {e.logprob}, not the best {tops[0]}"


def test_seeded_sampling_reproduces_and_seeds_differ(swarm, client):
    def sample(seed: int) -> str:
        r = client.completions.create(model=swarm.model, prompt=PROMPT, max_tokens=16, temperature=0.8, seed=seed)
        return r.choices[0].text

    first, again = sample(42), sample(42)
    assert first == again, f"seed 42 gave {first!r}, then {again!r}"
    others = {seed: sample(seed) for seed in (1, 2, 3)}
    assert any(t != first for t in others.values()), f"seeds 1, 2, 3 all gave seed 42's text {first!r}"


def test_stop_string_ends_the_text_before_it(swarm, client):
    free = client.completions.create(model=swarm.model, prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    words = free.choices[0].text.split()
    assert len(words) >= 4, f"too few words to pick a stop string from: {free.choices[0].text!r}"
    stop = " " + words[len(words) // 2]
    expected = free.choices[0].text[: free.choices[0].text.index(stop)]
    for stream in (False, True):
        kw = dict(model=swarm.model, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop], extra_body={"ignore_eos": True})
        if stream:
            chunks = list(client.completions.create(**kw, stream=True))
            text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
            reason = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason][-1]
        else:
            r = client.completions.create(**kw)
            text, reason = r.choices[0].text, r.choices[0].finish_reason
            assert r.usage.completion_tokens < 24, f"the stop {stop!r} did not end the generation early: {r.usage}"
        assert reason == "stop", f"stream={stream}: finish_reason {reason!r} with stop {stop!r}"
        assert stop not in text, f"stream={stream}: the stop {stop!r} is in the text {text!r}"
        assert text == expected, f"stream={stream}: {text!r}, expected the text before {stop!r}: {expected!r}"


def test_greedy_output_equals_dgr_generate_token_for_token(swarm, client):
    prompt = "The three most useful things to know about distributed inference are"
    r = client.completions.create(model=swarm.model, prompt=prompt, max_tokens=32, temperature=0, logprobs=1)
    one = json.loads(run_dgr("generate", "--prompt", prompt, "--max-tokens", "32", "--format", "json", "--threads", "1", timeout=120))
    api_lp = r.choices[0].logprobs
    assert r.usage.prompt_tokens == len(one["prompt_tokens"]), f"prompt tokens: API {r.usage.prompt_tokens}, generate {len(one['prompt_tokens'])}"
    assert r.usage.completion_tokens == len(one["tokens"]), f"tokens: API {r.usage.completion_tokens}, generate {len(one['tokens'])}"
    assert r.choices[0].text == one["text"], f"API {r.choices[0].text!r} != generate {one['text']!r}"
    assert api_lp.token_logprobs == one["logprobs"], (
        "logprobs differ: " + ", ".join(f"#{i}: {a} vs {b}" for i, (a, b) in enumerate(zip(api_lp.token_logprobs, one["logprobs"])) if a != b)
    )



# A system prompt of about 120 tokens: the first turn's prompt fills seven blocks of 16.
SYSTEM = (
    "You answer questions about serving language models, briefly and precisely. A server that splits a model "
    "across machines keeps, on every machine, the keys and values each token of a prompt left in the layers it "
    "holds. When a later prompt starts with the same tokens, those keys and values can be copied instead of "
    "computed again, which saves most of the time to the first token of a long conversation. Say so when you "
    "do not know."
)


def test_a_chat_second_turn_attaches_the_first_and_equals_a_cold_run(swarm, client):
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What does a prefix cache keep?"}]
    r1 = client.chat.completions.create(model=swarm.model, messages=first, max_tokens=24, temperature=0)
    second = first + [
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "And what does it save?"},
    ]
    r2 = client.chat.completions.create(model=swarm.model, messages=second, max_tokens=16, temperature=0, logprobs=True)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    whole_blocks = r1.usage.prompt_tokens // 16 * 16
    assert cached >= whole_blocks > 0, f"the second turn attached {cached} tokens; the first turn's prompt holds {whole_blocks} in full blocks"
    assert cached < r2.usage.prompt_tokens, r2.usage
    # Another key is another tenant: it sees none of these blocks, computes the whole prompt, and
    # must get the same tokens and logprobs.
    cold = swarm.client("cold").chat.completions.create(model=swarm.model, messages=second, max_tokens=16, temperature=0, logprobs=True)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0, cold.usage
    assert cold.choices[0].message.content == r2.choices[0].message.content, f"cold {cold.choices[0].message.content!r} != hit {r2.choices[0].message.content!r}"
    lps = lambda r: [t.logprob for t in r.choices[0].logprobs.content]
    assert lps(cold) == lps(r2), f"logprobs: cold {lps(cold)} != hit {lps(r2)}"
    # Streamed, the usage chunk reports the cached tokens too.
    chunks = list(
        client.chat.completions.create(
            model=swarm.model, messages=second, max_tokens=16, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    last = chunks[-1].usage
    assert last.prompt_tokens_details.cached_tokens >= cached, f"streamed usage {last}"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == r2.choices[0].message.content
