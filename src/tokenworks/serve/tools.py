"""Tool calling: tell the model its tools, read its calls back, and force a call when asked.

How a model writes a call depends on its family (serve/tool_formats.py); the one here,
streamed as it is generated, is the Hermes / Qwen / SmolLM form, a JSON object inside tags,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

with results shown to the model inside <tool_response> tags. A chat template that knows
about tools gets them as the `tools` variable; otherwise the tools are described in the
system message.

`tool_choice` "required" (Anthropic "any") or a named function is enforced with a grammar
(engine/structured.py): the output must be exactly one call in the format's syntax whose
arguments validate against that tool's parameter schema (objects closed to undeclared
keys, as in OpenAI's strict mode), so the call always parses. "auto" leaves it to the
model; "none" hides the tools.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from tokenworks.engine.request import StructuredOutput
from tokenworks.serve.errors import bad_request

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict  # a JSON schema for the arguments object

    def as_openai(self) -> dict:
        fn = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": fn}


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of the arguments object


def new_call_id(prefix: str = "call_") -> str:
    return prefix + secrets.token_hex(12)


def _check_schema(schema, where: str) -> dict:
    if schema is None:
        return {"type": "object", "properties": {}}
    if not isinstance(schema, dict):
        raise bad_request(f"{where} must be a JSON schema object", "tools")
    return schema


def openai_tools(tools: list[dict] | None) -> list[Tool]:
    out = []
    for i, t in enumerate(tools or []):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or t.get("type", "function") != "function":
            raise bad_request(
                f'tools[{i}] must be {{"type": "function", "function": {{"name", ...}}}}', "tools"
            )
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"tools[{i}].function.name must be a non-empty string", "tools")
        params = _check_schema(fn.get("parameters"), f"tools[{i}].function.parameters")
        out.append(Tool(name, fn.get("description") or "", params))
    return out


def anthropic_tools(tools: list[dict] | None) -> list[Tool]:
    out = []
    for i, t in enumerate(tools or []):
        name = t.get("name") if isinstance(t, dict) else None
        if not isinstance(name, str) or not name:
            raise bad_request(f"tools.{i}.name must be a non-empty string", "tools")
        if t.get("type") not in (None, "custom"):
            raise bad_request(
                f"tools.{i}: server tool type {t.get('type')!r} is not supported here", "tools"
            )
        params = _check_schema(t.get("input_schema"), f"tools.{i}.input_schema")
        out.append(Tool(name, t.get("description") or "", params))
    return out


# ------------------------------------------------------------------ choice -> constraint


def choose(tools: list[Tool], mode: str, name: str | None, fmt) -> StructuredOutput | None:
    """The grammar that enforces a tool choice, mode "required" (any tool) or "named", in
    the call syntax of fmt (a serve/tool_formats.py ToolFormat)."""
    if mode == "named":
        chosen = [t for t in tools if t.name == name]
        if not chosen:
            known = ", ".join(t.name for t in tools) or "none"
            raise bad_request(
                f"tool_choice names {name!r}, which is not in tools ({known})", "tool_choice"
            )
    elif mode == "required":
        chosen = tools
    else:
        return None
    if not chosen:
        raise bad_request(f"tool_choice {mode!r} needs at least one tool in tools", "tool_choice")
    return StructuredOutput.lark(fmt.grammar(chosen))


def resolve(
    tool_list: list[Tool], mode: str, name: str | None, constraint, conflict: str, fmt
) -> tuple[list[Tool], StructuredOutput | None]:
    """The tools the prompt offers and the one grammar the output must follow: a forced
    tool choice's, or the request's own output format. Both at once is a 400 (`conflict`
    says so in the protocol's words)."""
    forced = choose(tool_list, mode, name, fmt)
    if forced is not None and constraint is not None:
        raise bad_request(conflict, "tool_choice")
    return (tool_list if mode != "none" else []), forced or constraint


def openai_choice(tool_choice, tools: list[Tool]) -> tuple[str, str | None]:
    """OpenAI tool_choice -> (mode, name): mode is auto, none, required or named."""
    if tool_choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(tool_choice, str):
        if tool_choice not in ("auto", "none", "required"):
            raise bad_request(
                f"tool_choice {tool_choice!r} is not auto, none, required or "
                '{"type": "function", "function": {"name": ...}}',
                "tool_choice",
            )
        return tool_choice, None
    fn = tool_choice.get("function") if tool_choice.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request(
            'a named tool_choice is {"type": "function", "function": {"name": ...}}', "tool_choice"
        )
    return "named", fn["name"]


def anthropic_choice(tool_choice, tools: list[Tool]) -> tuple[str, str | None]:
    if tool_choice is None:
        return ("auto" if tools else "none"), None
    kind = tool_choice.get("type")
    if kind in ("auto", "none"):
        return kind, None
    if kind == "any":
        return "required", None
    if kind == "tool" and isinstance(tool_choice.get("name"), str):
        return "named", tool_choice["name"]
    raise bad_request(
        'tool_choice.type must be auto, any, none, or tool (with a "name")', "tool_choice"
    )


# ------------------------------------------------------------------ the prompt


def prepare_messages(
    messages: list[dict], tools: list[Tool], template_source: str, fmt
) -> tuple[list[dict], dict]:
    """Messages (OpenAI shape) -> what the chat template gets: messages and extra kwargs.

    A template that mentions tools renders them itself. For one that does not, the tools
    go into the system message in fmt's words (a serve/tool_formats.py ToolFormat),
    assistant tool calls are written in its call syntax and tool results become
    <tool_response> blocks in a user turn.
    """
    if "tool" in template_source:
        return messages, ({"tools": [t.as_openai() for t in tools]} if tools else {})
    out: list[dict] = []
    for m in messages:
        role = m["role"]
        if role == "assistant" and m.get("tool_calls"):
            blocks = [m.get("content") or ""]
            for c in m["tool_calls"]:
                fn = c.get("function", {})
                blocks.append(fmt.render_call(fn.get("name", ""), _arguments(fn)))
            out.append({"role": "assistant", "content": "\n".join(b for b in blocks if b)})
        elif role == "tool":
            piece = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1].get("_tool"):
                out[-1]["content"] += "\n" + piece
            else:
                out.append({"role": "user", "content": piece, "_tool": True})
        else:
            out.append(dict(m))
    for m in out:
        m.pop("_tool", None)
    if tools:
        text = fmt.describe(tools)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{text}"
        else:
            out.insert(0, {"role": "system", "content": text})
    return out, {}


def _arguments(fn: dict):
    """A call's arguments as a value (they come as JSON text, or already parsed)."""
    arguments = fn.get("arguments", {})
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            pass
    return arguments


# ------------------------------------------------------------------ reading calls back


# A call the way the format (and the forcing grammar) writes it: name first, then arguments.
# Once this much is seen, the arguments can stream as they are generated.
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\S)')
_TAIL = re.compile(r"\s*\}?\s*$")  # what may still be the call's closing brace


class ToolCallParser:
    """Splits generated text into plain text and tool calls as it streams in.

    feed() returns events: ("text", str), ("call_start", ToolCall) once the call's name is
    known, ("call_args", str) for each new piece of its arguments' JSON text, and
    ("call_end", ToolCall) with the complete arguments. Text that might be the start of a
    <tool_call> tag, or the call's own closing brace, is held back until it is clear;
    finish() flushes the rest. A block that is not a call comes back as text. The
    non-streamed answer runs through the same parser, so both agree.
    """

    def __init__(self, id_prefix: str = "call_"):
        self._buf = ""
        self._in_call = False
        self._after_call = False
        self._prefix = id_prefix
        self._current: ToolCall | None = None
        self._args_at = 0  # where the arguments start in the call's text
        self._sent = ""  # the arguments text handed out so far
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[tuple[str, object]]:
        self._buf += text
        events: list[tuple[str, object]] = []
        while True:
            if self._in_call:
                j = self._buf.find(CLOSE)
                if j < 0:
                    return events + self._stream_args()
                body, self._buf = self._buf[:j], self._buf[j + len(CLOSE) :]
                self._in_call = False
                events += self._end_call(body)
                continue
            i = self._buf.find(OPEN)
            if i >= 0:
                events += self._text(self._buf[:i])
                self._buf = self._buf[i + len(OPEN) :]
                self._in_call = True
                continue
            keep = partial_suffix(self._buf, OPEN)
            events += self._text(self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
            return events

    def finish(self) -> list[tuple[str, object]]:
        rest, self._buf = self._buf, ""
        if self._in_call:  # cut short (max_tokens)
            self._in_call = False
            return self._end_call(rest, unclosed=True)
        return self._text(rest)

    def _text(self, text: str) -> list[tuple[str, object]]:
        if self._after_call:
            text = text.lstrip()
        if not text:
            return []
        self._after_call = False
        return [("text", text)]

    def _stream_args(self) -> list[tuple[str, object]]:
        events: list[tuple[str, object]] = []
        if self._current is None:
            head = _CALL_HEAD.match(self._buf)
            if head is None:
                return events
            self._current = ToolCall(new_call_id(self._prefix), json.loads(head.group(1)), "")
            self._args_at, self._sent = head.end(), ""
            events.append(("call_start", self._current))
        pending = self._buf[self._args_at :]
        pending = pending[: len(pending) - partial_suffix(pending, CLOSE)]
        safe = pending[: _TAIL.search(pending).start()]
        if len(safe) > len(self._sent) and safe.startswith(self._sent):
            events.append(("call_args", safe[len(self._sent) :]))
            self._sent = safe
        return events

    def _end_call(self, body: str, unclosed: bool = False) -> list[tuple[str, object]]:
        events: list[tuple[str, object]] = []
        if unclosed:  # cut short: inside the closing tag, the call itself may be whole
            body = body[: len(body) - partial_suffix(body, CLOSE)]
            unclosed = not _is_json(body)
        if self._current is None:
            self._buf, rest = body, self._buf
            events += self._stream_args()  # the head may only now be complete
            self._buf = rest
        call = self._current
        if call is not None:
            args = body[self._args_at :].strip()
            if args.endswith("}") and not unclosed:
                args = args[:-1].rstrip()  # the call object's own closing brace
            if args.startswith(self._sent) and len(args) > len(self._sent):
                events.append(("call_args", args[len(self._sent) :]))
            call.arguments = args
        else:
            try:
                parsed = parse_call(json.loads(body.strip()))
            except json.JSONDecodeError:
                parsed = None
            if parsed is None:
                return events + self._text(OPEN + body + ("" if unclosed else CLOSE))
            name, arguments = parsed
            call = ToolCall(new_call_id(self._prefix), name, json.dumps(arguments))
            events += [("call_start", call), ("call_args", call.arguments)]
        self._current, self._sent = None, ""
        self.calls.append(call)
        self._after_call = True
        return events + [("call_end", call)]


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def parse_call(obj) -> tuple[str, dict] | None:
    """(name, arguments) of a call object {"name", "arguments" or "parameters"}, or None
    if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], args
