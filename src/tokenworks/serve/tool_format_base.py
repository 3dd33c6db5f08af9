"""What every tool-call format shares (serve/tool_formats.py lists the formats): a format's
interface, its markers as grammar terminals, and the parser of formats read whole."""

from __future__ import annotations

import json

from tokenworks.engine.request import JSON_OPTIONS, close_objects
from tokenworks.serve.tools import (
    CLOSE,
    OPEN,
    Tool,
    ToolCall,
    ToolCallParser,
    new_call_id,
    partial_suffix,
)


class ToolFormat:
    name = "hermes"
    start = OPEN  # where calls begin in the output
    args_key = "arguments"  # what the call object names its arguments

    channels = False  # whether its parser reads the whole answer, thinking too (harmony)
    answer_markers: tuple[str, ...] = ()  # what it wraps its answer's text in (not the text)
    stray_thinking: tuple[str, ...] = ()  # thinking markers an answer may repeat (Gemma 4's)

    def __init__(self, tokenizer=None):
        self.special_marker, self._marker_rule = marker_terminal(tokenizer, self.start)

    @property
    def starts(self) -> tuple[str, ...]:
        """Where calls may begin, read whole (Qwen3-Coder's begin at <function= as well)."""
        return (self.start,)

    def parser(self, tools: list[Tool], id_prefix: str):
        return ToolCallParser(id_prefix)

    def describe(self, tools: list[Tool]) -> str:
        """The system-message text for a chat template that does not render tools itself."""
        lines = "\n".join(json.dumps(t.as_openai()) for t in tools)
        return (
            "You can call functions to help answer. These are the functions you can call, "
            "each described as JSON inside <tools></tools>:\n"
            f"<tools>\n{lines}\n</tools>\n\n" + self.how_to_call()
        )

    def how_to_call(self) -> str:
        return (
            "To call a function, answer with a JSON object holding its name and arguments "
            f"inside {OPEN}{CLOSE} tags, one block per call:\n"
            f'{OPEN}\n{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}\n{CLOSE}'
        )

    def render_call(self, name: str, arguments: dict) -> str:
        return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{CLOSE}"

    def grammar(self, tools: list[Tool]) -> str:
        """A Lark grammar whose language is exactly one call of one of `tools`, its
        arguments valid against the tool's schema (objects closed to undeclared keys)."""
        return f'start: {self._marker_rule} "\\n" call "\\n{CLOSE}"\n' + self._json_call(tools)

    def _call_schema(self, tool: Tool) -> dict:
        """The JSON schema of one call of `tool` as the format writes it."""
        key = self.args_key
        return {
            "type": "object",
            "properties": {"name": {"const": tool.name}, key: close_objects(tool.parameters)},
            "required": ["name", key],
            "additionalProperties": False,
        }

    def _json_call(self, tools: list[Tool]) -> str:
        schemas = [self._call_schema(t) for t in tools]
        schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        schema["x-guidance"] = JSON_OPTIONS
        return f"call: %json {json.dumps(schema)}\n"


def marker_terminal(tokenizer, marker: str) -> tuple[bool, str]:
    """A marker as a grammar terminal: (True, its token) where it is one special token of
    the tokenizer, else (False, its text)."""
    if tokenizer is not None and marker:
        ids = tokenizer.encode(marker, add_special_tokens=False)
        if len(ids) == 1 and tokenizer.decode(ids, skip_special_tokens=True) == "":
            return True, f"<[{ids[0]}]>"
    return False, json.dumps(marker)


MAX_TEXT = 256  # characters of a forced string without a maxLength


def value_rule(schema, stops: str = "<\\n") -> str:
    """A forced value: JSON valid against schema, a string as text without `stops` (regex
    class characters), which the markup after it begins with."""
    if not isinstance(schema, dict):
        schema = {}
    if schema.get("type") == "string":
        return f"/[^{stops}]{{1,{min(int(schema.get('maxLength', MAX_TEXT)), MAX_TEXT)}}}/"
    return f"%json {json.dumps(close_objects(schema) | {'x-guidance': JSON_OPTIONS})}"


def arguments_rules(tools: list[Tool]) -> list[str]:
    """Grammar rules args0, args1, ...: each tool's arguments, JSON valid against its
    schema."""
    return [f"args{i}: {value_rule(t.parameters)}" for i, t in enumerate(tools)]


def ordered_arguments(pairs: dict[str, str], required: set, sep: str) -> str:
    """The grammar of a call's arguments from each one's rule (by name, in declared order):
    the required ones in order, then each optional one at most once, joined by the Lark
    literal sep."""
    first = [rule for k, rule in pairs.items() if k in required]
    rest = [rule for k, rule in pairs.items() if k not in required]
    if first:
        return f" {sep} ".join(first) + "".join(f" ({sep} {r})?" for r in rest)
    if rest:
        return f"({rest[0]}" + "".join(f" ({sep} {r})?" for r in rest[1:]) + ")?"
    return ""


def json_value(text: str, default=None):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return default


class WholeCallsParser:
    """The ToolCallParser interface for formats read whole: text streams until the start
    of the calls (for llama3_json, also a "{" opening the answer); from there everything is
    held, and read as calls when the completion ends (as text, if it is not calls)."""

    def __init__(self, fmt: ToolFormat, tools: list[Tool], id_prefix: str, leading_brace=False):
        self.fmt, self.tools, self._prefix = fmt, tools, id_prefix
        self._buf, self._in_calls, self._at_start = "", False, leading_brace
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[tuple[str, object]]:
        self._buf += text
        if self._in_calls:
            return []
        if self._at_start:
            head = self._buf.lstrip()
            if not head:
                return []
            self._at_start = False
            if head.startswith("{"):
                self._in_calls, self._buf = True, head
                return []
        found = [i for i in (self._buf.find(m) for m in self.fmt.starts) if i >= 0]
        i = min(found, default=-1)
        if i >= 0:
            text, self._buf, self._in_calls = self._buf[:i], self._buf[i:], True
            return [("text", text)] if text else []
        keep = max(partial_suffix(self._buf, m) for m in self.fmt.starts)
        text, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep :]
        return [("text", text)] if text else []

    def finish(self) -> list[tuple[str, object]]:
        region, self._buf = self._buf, ""
        if not region:
            return []
        parsed = self.fmt.parse(region, self.tools) if self._in_calls else None
        if parsed is None:
            return [("text", region)]
        events: list[tuple[str, object]] = []
        for name, arguments in parsed:
            call = ToolCall(new_call_id(self._prefix), name, json.dumps(arguments))
            self.calls.append(call)
            events += [("call_start", call), ("call_args", call.arguments), ("call_end", call)]
        return events
