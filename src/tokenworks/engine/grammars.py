"""A request's structured output as an llguidance grammar: JSON schemas (objects closed as in
OpenAI's strict mode), regexes, choice lists and Lark, with the errors a bad one raises.
engine/structured.py turns a grammar into each step's token mask."""

from __future__ import annotations

import json

from tokenworks.engine.request import (
    JSON_OPTIONS,
    StructuredOutput,
    StructuredOutputError,
    close_objects,
)


def load_llguidance():
    try:
        import llguidance
    except ImportError as e:  # pragma: no cover - llguidance is a base dependency
        raise StructuredOutputError(
            "structured output needs llguidance: pip install llguidance"
        ) from e
    return llguidance


def grammar_source(so: StructuredOutput) -> str:
    """The llguidance grammar for one StructuredOutput."""
    M = load_llguidance().LLMatcher
    if so.kind == "json_schema":
        try:
            schema = close_objects(json.loads(so.value))
            return M.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except ValueError as e:
            raise StructuredOutputError(f"json_schema: {e}") from e
    if so.kind == "json_object":
        return M.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if so.kind == "regex":
        return M.grammar_from_regex(so.value)
    if so.kind == "choice":
        return M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in so.choices))
    return M.grammar_from_lark(so.value)
