"""Structured output through the official client: 200 seeded generations against 10 JSON schemas
(nested objects, enums, arrays, required fields, bounded numbers) that all parse and validate,
`response_format` json_object, `client.beta.chat.completions.parse` with a Pydantic model, a Lark
grammar on completions, invalid schemas refused with a 400 naming them, and a constrained seeded
run that reproduces (streamed or not)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest

# Bounded so that a completion always fits its max_tokens: short strings, few items.
NAME = {"type": "string", "minLength": 1, "maxLength": 12}
SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "colour": {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "green", "blue"]}, "shade": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["colour", "shade"],
        "additionalProperties": False,
    },
    "tags": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    "address": {
        "type": "object",
        "properties": {
            "city": NAME,
            "geo": {
                "type": "object",
                "properties": {
                    # Integer degrees: a free number's fraction can run past any max_tokens.
                    "lat": {"type": "integer", "minimum": -90, "maximum": 90},
                    "lon": {"type": "integer", "minimum": -180, "maximum": 180},
                },
                "required": ["lat", "lon"],
                "additionalProperties": False,
            },
        },
        "required": ["city", "geo"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
                "minItems": 1,
                "maxItems": 2,
            },
            "paid": {"type": "boolean"},
        },
        "required": ["items", "paid"],
        "additionalProperties": False,
    },
    "rating": {
        "type": "object",
        "properties": {"score": {"type": "number", "minimum": 0, "maximum": 5}, "verdict": {"enum": ["good", "bad", "fine"]}},
        "required": ["score", "verdict"],
        "additionalProperties": False,
    },
    "matrix": {
        "type": "object",
        "properties": {
            "rows": {
                "type": "array",
                "items": {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 9}, "minItems": 2, "maxItems": 2},
                "minItems": 2,
                "maxItems": 2,
            }
        },
        "required": ["rows"],
        "additionalProperties": False,
    },
    "event": {
        "type": "object",
        "properties": {
            "title": NAME,
            "day": {"enum": ["mon", "tue", "wed", "thu", "fri"]},
            "guests": {"type": "integer", "minimum": 0, "maximum": 50},
            "online": {"type": "boolean"},
        },
        "required": ["title", "day", "guests"],
        "additionalProperties": False,
    },
    "tree": {
        "type": "object",
        "properties": {
            "root": {
                "type": "object",
                "properties": {
                    "label": {"type": "string", "maxLength": 6},
                    "child": {
                        "type": "object",
                        "properties": {"label": {"type": "string", "maxLength": 6}, "leaf": {"type": "boolean"}},
                        "required": ["label", "leaf"],
                        "additionalProperties": False,
                    },
                },
                "required": ["label", "child"],
                "additionalProperties": False,
            }
        },
        "required": ["root"],
        "additionalProperties": False,
    },
    "reading": {
        "type": "object",
        "properties": {
            "sensor": {"enum": ["t1", "t2"]},
            "values": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100}, "minItems": 1, "maxItems": 4},
            "unit": {"type": "string", "enum": ["C", "F"]},
        },
        "required": ["sensor", "values", "unit"],
        "additionalProperties": False,
    },
}
PER_SCHEMA = 20
MAX_TOKENS = 128


def schema_format(name: str, schema: dict, strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": strict}}


def test_200_generations_against_10_schemas_all_parse_and_validate(swarm, client):
    assert len(SCHEMAS) == 10

    def one(job):
        name, seed = job
        r = client.chat.completions.create(
            model=swarm.model,
            messages=[{"role": "user", "content": f"Give me a {name} as JSON."}],
            max_tokens=MAX_TOKENS,
            temperature=0.8,
            seed=seed,
            response_format=schema_format(name, SCHEMAS[name]),
        )
        return name, seed, r.choices[0]

    jobs = [(name, seed) for name in SCHEMAS for seed in range(PER_SCHEMA)]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, jobs))
    assert len(results) == 200
    failures = []
    for name, seed, choice in results:
        try:
            assert choice.finish_reason == "stop", f"finish_reason {choice.finish_reason}"
            jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])
        except (AssertionError, ValueError, jsonschema.ValidationError) as e:
            failures.append(f"{name} seed {seed}: {e}: {choice.message.content!r}")
    assert not failures, f"{len(failures)} of 200 failed:\n" + "\n".join(failures[:10])


def test_json_object_is_a_json_object(swarm, client):
    r = client.chat.completions.create(
        model=swarm.model,
        messages=[{"role": "user", "content": "Describe a cat in JSON."}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        response_format={"type": "json_object"},
    )
    c = r.choices[0]
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.message.content), dict), c.message.content
    else:
        # Cut off by max_tokens: a prefix of an object, never anything else.
        assert c.finish_reason == "length" and c.message.content.startswith("{"), c


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    kind: Literal["cat", "dog", "fish"]
    legs: int = pydantic.Field(ge=0, le=4)


def test_pydantic_parse_through_the_official_client(swarm, client):
    r = client.beta.chat.completions.parse(
        model=swarm.model,
        messages=[{"role": "user", "content": "Invent a pet."}],
        max_tokens=MAX_TOKENS,
        temperature=0.5,
        seed=7,
        response_format=Pet,
    )
    pet = r.choices[0].message.parsed
    assert isinstance(pet, Pet), r
    assert pet.kind in ("cat", "dog", "fish") and 0 <= pet.legs <= 4, pet


def test_lark_grammar_on_completions(swarm, client):
    grammar = 'start: " " answer "." \nanswer: "yes" | "no" | "maybe"'
    for seed in range(5):
        r = client.completions.create(
            model=swarm.model, prompt="Is the sky blue? Answer:", max_tokens=8, temperature=1.0, seed=seed, extra_body={"grammar": grammar}
        )
        c = r.choices[0]
        assert c.text in (" yes.", " no.", " maybe."), c
        assert c.finish_reason == "stop", c


def test_a_constrained_seeded_run_reproduces_streamed_or_not(swarm, client):
    fmt = schema_format("event", SCHEMAS["event"])
    ask = dict(
        model=swarm.model, messages=[{"role": "user", "content": "Plan an event."}], max_tokens=MAX_TOKENS, temperature=0.9, seed=11
    )
    a = client.chat.completions.create(response_format=fmt, **ask).choices[0].message.content
    b = client.chat.completions.create(response_format=fmt, **ask).choices[0].message.content
    chunks = client.chat.completions.create(response_format=fmt, stream=True, **ask)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert a == b == streamed, (a, b, streamed)
    jsonschema.validate(json.loads(a), SCHEMAS["event"])


@pytest.mark.parametrize(
    "fmt, says",
    [
        (schema_format("bad", {"type": "object", "properties": {"a": {"type": "strin"}}}), "strin"),
        (schema_format("bad", {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}), "nowhere"),
        (schema_format("bad", {"type": "integer", "minimum": 5, "maximum": 1}), "minimum"),
        ({"type": "json_schema", "json_schema": {"name": "no spaces allowed", "schema": {}}}, "name"),
        ({"type": "yaml"}, "response_format.type"),
    ],
)
def test_invalid_schemas_get_a_400_naming_the_problem(swarm, client, fmt, says):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=swarm.model, messages=[{"role": "user", "content": "x"}], max_tokens=4, response_format=fmt)
    assert e.value.status_code == 400
    body = e.value.body or {}
    assert body.get("param") == "response_format", body
    assert says in body.get("message", ""), body
