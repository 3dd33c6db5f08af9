"""Structured outputs: llguidance token masks in the sampler. Whatever the model would have
said, the output parses and validates against the schema."""

from __future__ import annotations

import json
import re

import anthropic
import jsonschema
import openai
import pytest

from tokenworks import SamplingParams
from tokenworks.engine.request import SamplingError, StructuredOutput, StructuredOutputError

MODEL = "smollm2-135m"
NAME = {"type": "string", "minLength": 1, "maxLength": 24}

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
    },
    "array_of_ints": {
        "type": "object",
        "properties": {
            "primes": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 5}
        },
        "required": ["primes"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "book": {
                "type": "object",
                "properties": {
                    "title": NAME,
                    "author": {
                        "type": "object",
                        "properties": {"first": NAME, "last": NAME},
                        "required": ["first", "last"],
                    },
                },
                "required": ["title", "author"],
            }
        },
        "required": ["book"],
    },
    "array_of_objects": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {"sku": NAME, "qty": {"type": "integer", "minimum": 1}},
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["items"],
    },
    "booleans_and_numbers": {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "score": {"type": "number"}},
        "required": ["ok", "score"],
    },
    "nullable": {
        "type": "object",
        "properties": {"nickname": {"anyOf": [NAME, {"type": "null"}]}},
        "required": ["nickname"],
    },
    "string_enum_array": {
        "type": "object",
        "properties": {
            "days": {
                "type": "array",
                "items": {"enum": ["mon", "tue", "wed", "thu", "fri"]},
                "minItems": 1,
                "maxItems": 5,
            }
        },
        "required": ["days"],
    },
    "top_level_array": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3},
    "optional_fields": {
        "type": "object",
        "properties": {"city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["city", "zip"],
    },
    "defs_and_refs": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
    },
}


@pytest.fixture(scope="module")
def client(smol_server):
    return openai.OpenAI(
        base_url=smol_server.url + "/v1", api_key="unused", max_retries=0, timeout=120
    )


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_output_validates(client, name):
    schema = SCHEMAS[name]
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"Give me an example {name.replace('_', ' ')}."}],
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema}},
        max_tokens=200,
        temperature=0,
    )
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_sampled_json_object_and_n(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a cat as JSON."}],
        response_format={"type": "json_object"},
        max_tokens=300,
        temperature=0.7,
        seed=5,
        n=2,
        extra_body={"structured_outputs": None},
    )
    assert len(r.choices) == 2
    assert any(c.finish_reason == "stop" for c in r.choices), "no sampled object closed"
    for c in r.choices:
        assert c.message.content.lstrip().startswith("{")  # the grammar held from the start
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content), dict)


def test_regex_choice_and_grammar_extensions(client):
    def complete(**extra):
        return (
            client.completions.create(
                model=MODEL, prompt="Answer:", max_tokens=30, temperature=0, extra_body=extra
            )
            .choices[0]
            .text
        )

    assert re.fullmatch(
        r"[0-9]{3}-[0-9]{4}", complete(structured_outputs={"regex": r"[0-9]{3}-[0-9]{4}"})
    )
    assert complete(structured_outputs={"choice": ["yes", "no", "maybe"]}) in ("yes", "no", "maybe")
    assert complete(guided_choice=["alpha", "beta"]) in ("alpha", "beta")
    grammar = 'start: "(" NUM ("+" NUM)? ")"\nNUM: /[1-9]/'
    assert re.fullmatch(r"\([1-9](\+[1-9])?\)", complete(structured_outputs={"grammar": grammar}))


def test_anthropic_output_format(smol_server):
    claude = anthropic.Anthropic(
        base_url=smol_server.url, api_key="unused", max_retries=0, timeout=120
    )
    schema = SCHEMAS["person"]
    msg = claude.messages.create(
        model=MODEL,
        max_tokens=100,
        messages=[{"role": "user", "content": "Invent a person."}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )
    jsonschema.validate(json.loads(msg.content[0].text), schema)


def test_bad_grammars_are_the_callers_error(client, smol_llm):
    with pytest.raises(openai.BadRequestError, match="regex"):
        client.completions.create(
            model=MODEL, prompt="x", max_tokens=3, extra_body={"guided_regex": "[unclosed"}
        )
    with pytest.raises(openai.BadRequestError, match="one output constraint"):
        client.completions.create(
            model=MODEL,
            prompt="x",
            max_tokens=3,
            extra_body={"guided_regex": "a", "guided_choice": ["b"]},
        )
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_schema", "json_schema": {"name": "x"}},
        )
    with pytest.raises(SamplingError):
        StructuredOutput.choice([])
    with pytest.raises(StructuredOutputError):
        smol_llm.engine.grammars.compile(StructuredOutput.lark("start: undefined_rule"))


def test_offline_api_takes_a_schema(smol_llm):
    schema = SCHEMAS["enum"]
    out = smol_llm.generate(
        "Pick a colour:",
        SamplingParams(max_tokens=30, temperature=0, structured=StructuredOutput.json(schema)),
    )[0].outputs[0]
    jsonschema.validate(json.loads(out.text), schema)
    assert out.finish_reason == "stop"


def test_batched_masks_match_each_matchers_own_bitmask(smol_llm):
    import numpy as np
    import torch

    grammars = smol_llm.engine.grammars
    tok = smol_llm.engine.tokenizer
    vocab = smol_llm.engine.spec.vocab_size
    matchers = []
    for so, text in [
        (StructuredOutput.json(SCHEMAS["person"]), '{"name": "Al'),
        (StructuredOutput.json(SCHEMAS["person"]), ""),
        (StructuredOutput.regex(r"[0-9]{3}-[a-z]+"), "12"),
    ]:
        m = grammars.compile(so)
        for t in tok.encode(text, add_special_tokens=False):
            m.accept(t)
        matchers.append(m)
    logits = torch.zeros(4, vocab)
    rows = [(0, matchers[0]), (2, matchers[1]), (3, matchers[2])]
    grammars.mask_rows(logits, rows)
    assert torch.isfinite(logits[1]).all()  # an unguided row is left alone
    for r, m in rows:
        bits = np.unpackbits(
            np.frombuffer(m._m.compute_bitmask(), dtype=np.uint8), bitorder="little"
        )[:vocab]
        assert np.array_equal(torch.isfinite(logits[r]).numpy(), bits.astype(bool))
        assert 0 < bits.sum() < vocab
