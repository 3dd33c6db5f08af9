"""Request fields -> StructuredOutput: OpenAI response_format, Anthropic output_config,
and the vLLM-style extensions (structured_outputs, guided_*) for regex, choice and Lark."""

from __future__ import annotations

from tokenworks.engine.request import SamplingError, StructuredOutput
from tokenworks.serve.errors import bad_request


def from_openai(req) -> StructuredOutput | None:
    """The one constraint an OpenAI request asks for, or None; two at once is a 400."""
    found: list[tuple[str, StructuredOutput]] = []
    try:
        rf = req.response_format
        if rf is not None:
            kind = rf.get("type")
            if kind == "json_object":
                found.append(("response_format", StructuredOutput.json()))
            elif kind == "json_schema":
                spec = rf.get("json_schema")
                if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                    raise bad_request(
                        "response_format.json_schema.schema must be a JSON schema object",
                        "response_format",
                    )
                found.append(("response_format", StructuredOutput.json(spec["schema"])))
            elif kind != "text":
                raise bad_request(
                    f"response_format.type {kind!r} is not one of text, json_object, json_schema",
                    "response_format",
                )
        so = req.structured_outputs
        if so is not None:
            options = [
                (so.json_ is not None, lambda: StructuredOutput.json(so.json_)),
                (bool(so.json_object), lambda: StructuredOutput.json()),
                (so.regex is not None, lambda: StructuredOutput.regex(so.regex)),
                (so.choice is not None, lambda: StructuredOutput.choice(so.choice)),
                (so.grammar is not None, lambda: StructuredOutput.lark(so.grammar)),
            ]
            found += [("structured_outputs", make()) for given, make in options if given]
        if req.guided_json is not None:
            found.append(("guided_json", StructuredOutput.json(req.guided_json)))
        if req.guided_regex is not None:
            found.append(("guided_regex", StructuredOutput.regex(req.guided_regex)))
        if req.guided_choice is not None:
            found.append(("guided_choice", StructuredOutput.choice(req.guided_choice)))
        if req.guided_grammar is not None:
            found.append(("guided_grammar", StructuredOutput.lark(req.guided_grammar)))
    except SamplingError as e:
        raise bad_request(str(e), "response_format") from e
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise bad_request(f"give one output constraint, not several ({names})", found[1][0])
    return found[0][1] if found else None


def from_anthropic(req) -> StructuredOutput | None:
    """output_config.format (or the beta's output_format): {"type": "json_schema", "schema"}."""
    fmt, field = None, "output_config.format"
    if req.output_config is not None:
        fmt = req.output_config.get("format")
    if fmt is None and req.output_format is not None:
        fmt, field = req.output_format, "output_format"
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise bad_request(f'{field}.type must be "json_schema"', field)
    if not isinstance(fmt.get("schema"), dict):
        raise bad_request(f"{field}.schema must be a JSON schema object", field)
    return StructuredOutput.json(fmt["schema"])
