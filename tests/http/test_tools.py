"""Tool calls through the official client: the tool-calling loop (call → tool result → final
answer) with a Llama-family model (the suite's SmolLM2, whose template knows no tools, so dgr
lists them in a system turn and reads Llama 3's JSON calls) and a Qwen-family one (a synthetic
qwen2 model carrying Qwen2.5's chat template, whose `tools` variable and `<tool_call>` format dgr
uses); `tool_choice: required` and a named function always yield a call whose arguments validate,
streamed or not; bad tools are refused by name."""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

import jsonschema
import openai
import pytest

from conftest import DGR, REPO, start_swarm, stop_swarm

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 8}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a time zone", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def valid_call(call) -> dict:
    """The call's arguments, checked against its function's schema."""
    assert call.type == "function" and call.id, call
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def tool_loop(client, model: str, max_tokens: int) -> tuple[dict, str]:
    """call (required) → the tool's result → a final answer (auto); the call's arguments and the answer."""
    messages = list(ASK)
    first = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, tool_choice="required", max_tokens=max_tokens, temperature=0
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    args = valid_call(call)
    messages.append(choice.message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "clear"})})
    final = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=16, temperature=0)
    answer = final.choices[0]
    assert answer.finish_reason in ("stop", "length"), answer
    assert answer.message.content and not answer.message.tool_calls, answer
    return args, answer.message.content


# Llama family: the suite's SmolLM2 ------------------------------------------------------------


def test_tool_loop_with_a_llama_family_model(swarm, client):
    args, answer = tool_loop(client, swarm.model, 64)
    assert args["unit"] in ("c", "f"), args


def test_required_always_yields_a_call_that_validates(swarm, client):
    for seed in range(12):
        r = client.chat.completions.create(
            model=swarm.model, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=64, temperature=1.0, seed=seed
        )
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", c
        [call] = c.message.tool_calls
        valid_call(call)


def test_a_named_function_is_the_one_called_streamed_or_not(swarm, client):
    named = {"type": "function", "function": {"name": "get_time"}}
    ask = dict(model=swarm.model, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=64, temperature=0.7, seed=3)
    whole = client.chat.completions.create(**ask).choices[0]
    [call] = whole.message.tool_calls
    assert call.function.name == "get_time", call
    valid_call(call)
    chunks = list(client.chat.completions.create(stream=True, **ask))
    deltas = [d for ch in chunks if ch.choices for d in (ch.choices[0].delta.tool_calls or [])]
    assert len(deltas) == 1 and deltas[0].function.name == "get_time", deltas
    assert json.loads(deltas[0].function.arguments) == json.loads(call.function.arguments)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"


def test_none_answers_in_text(swarm, client):
    r = client.chat.completions.create(model=swarm.model, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0)
    c = r.choices[0]
    assert c.message.content and not c.message.tool_calls and c.finish_reason in ("stop", "length"), c


@pytest.mark.parametrize(
    "tools, choice, param",
    [
        (TOOLS, "sometimes", "tool_choice"),
        (TOOLS, {"type": "function", "function": {"name": "launch"}}, "tool_choice"),
        ([{"type": "function", "function": {"name": "has space"}}], "auto", "tools"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}], "required", "tools"),
    ],
)
def test_bad_tools_get_a_400_naming_them(swarm, client, tools, choice, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=swarm.model, messages=ASK, tools=tools, tool_choice=choice, max_tokens=4)
    assert (e.value.body or {}).get("param") == param, e.value.body


# Qwen family: a synthetic qwen2 model with Qwen2.5's chat template ------------------------------


@pytest.fixture(scope="module")
def qwen():
    with tempfile.TemporaryDirectory(prefix="dgr-http-qwen-") as tmp:
        model = Path(tmp) / "qwen.gguf"
        template = REPO / "tests" / "data" / "chat-templates" / "qwen2.5.jinja"
        subprocess.run(
            [str(DGR), "synth", "--arch", "qwen2", "--chat-template", str(template), "--out", str(model)], check=True, capture_output=True
        )
        # A byte-level vocabulary: the template's tool list is hundreds of tokens.
        s = start_swarm(Path(tmp), model=model, max_prompt_tokens=4096, log_name="dgr-up-qwen.log")
        try:
            yield s
        finally:
            stop_swarm(s)


def test_tool_loop_with_a_qwen_family_model(qwen):
    client = qwen.client("free")
    plain = client.chat.completions.create(model=qwen.model, messages=ASK, max_tokens=1, temperature=0)
    with_tools = client.chat.completions.create(model=qwen.model, messages=ASK, tools=TOOLS, max_tokens=1, temperature=0)
    # The template's own tools section (every function's JSON) is in the prompt.
    listed = sum(len(json.dumps(t)) for t in TOOLS)
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + listed, (plain.usage, with_tools.usage)
    tool_loop(client, qwen.model, 256)


def test_qwen_required_calls_validate_streamed_or_not(qwen):
    client = qwen.client("free")
    for seed in range(4):
        ask = dict(model=qwen.model, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=256, temperature=1.0, seed=seed)
        [call] = client.chat.completions.create(**ask).choices[0].message.tool_calls
        valid_call(call)
        chunks = list(client.chat.completions.create(stream=True, **ask))
        [delta] = [d for ch in chunks if ch.choices for d in (ch.choices[0].delta.tool_calls or [])]
        assert (delta.function.name, json.loads(delta.function.arguments)) == (call.function.name, json.loads(call.function.arguments))
