"""How each model family writes a tool call, and how it is read back and forced.

    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>   (Hermes, Qwen2.5,
                 Qwen3, SmolLM)
    llama3_json  {"name": ..., "parameters": {...}} as the whole answer, or after
                 <|python_tag|>; several separated by ";"                  (Llama 3.1 to 3.3)
    mistral      [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...], or
                 [TOOL_CALLS]name[ARGS]{...} per call                      (Mistral, Mixtral)
    qwen3_coder  <tool_call><function=NAME><parameter=KEY>value</parameter>...</function>
                 </tool_call>                                              (Qwen3-Coder)
    harmony      <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}
                 <|call|>, thinking on the analysis channel (serve/harmony.py) (gpt-oss)
    deepseek_v3  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
                 ```json {...}```<｜tool▁call▁end｜>                        (DeepSeek R1, V3, V3.1)
    deepseek_v32 <｜DSML｜function_calls><｜DSML｜invoke name="NAME"><｜DSML｜parameter
                 name="KEY" string="true">...                              (DeepSeek V3.2, V4)

`--tool-call-parser` (vLLM's flag) picks one; auto reads the chat template. Hermes calls
stream their arguments as they are generated (serve/tools.py's ToolCallParser); the other
formats' calls are read whole once the completion ends, the text before them streaming as
it comes. Forcing a call (tool_choice required or named) writes the format's own syntax
through a grammar; a marker that is one special token of the tokenizer is matched as that
token, and its text is kept in the output so the parser can see it.
"""

from __future__ import annotations

import json
import re

from tokenworks.engine.request import JSON_OPTIONS, close_objects
from tokenworks.serve.harmony import CHANNEL, CONSTRAIN, MESSAGE, HarmonyParser
from tokenworks.serve.tools import (
    CLOSE,
    OPEN,
    Tool,
    ToolCall,
    ToolCallParser,
    new_call_id,
    parse_call,
    partial_suffix,
)

TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral", "qwen3_coder", "harmony",
                     "deepseek_v3", "deepseek_v32")  # fmt: skip


class ToolFormat:
    name = "hermes"
    start = OPEN  # where calls begin in the output
    args_key = "arguments"  # what the call object names its arguments

    channels = False  # whether its parser reads the whole answer, thinking too (harmony)

    def __init__(self, tokenizer=None):
        self.special_marker, self._marker_rule = _terminal(tokenizer, self.start)

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

    def _json_call(self, tools: list[Tool]) -> str:
        key = self.args_key
        schemas = [
            {
                "type": "object",
                "properties": {"name": {"const": t.name}, key: close_objects(t.parameters)},
                "required": ["name", key],
                "additionalProperties": False,
            }
            for t in tools
        ]
        schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        schema["x-guidance"] = JSON_OPTIONS
        return f"call: %json {json.dumps(schema)}\n"


def _terminal(tokenizer, marker: str) -> tuple[bool, str]:
    """A marker as a grammar terminal: (True, its token) where it is one special token of
    the tokenizer, else (False, its text)."""
    if tokenizer is not None and marker:
        ids = tokenizer.encode(marker, add_special_tokens=False)
        if len(ids) == 1 and tokenizer.decode(ids, skip_special_tokens=True) == "":
            return True, f"<[{ids[0]}]>"
    return False, json.dumps(marker)


class Llama3Json(ToolFormat):
    name, start, args_key = "llama3_json", "<|python_tag|>", "parameters"

    def parser(self, tools, id_prefix):
        return WholeCallsParser(self, tools, id_prefix, leading_brace=True)

    def how_to_call(self) -> str:
        return (
            "To call a function, answer with nothing but a JSON object of the form "
            '{"name": "<function name>", "parameters": {<arguments as JSON>}}; separate '
            'several calls with "; ".'
        )

    def render_call(self, name, arguments):
        return json.dumps({"name": name, "parameters": arguments})

    def grammar(self, tools):
        return "start: call\n" + self._json_call(tools)

    def parse(self, region: str, tools) -> list[tuple[str, dict]] | None:
        text, decoder, calls = region.replace(self.start, "", 1), json.JSONDecoder(), []
        i = 0
        while True:
            while i < len(text) and text[i] in " \t\r\n;":
                i += 1
            if i == len(text):
                return calls or None
            try:
                obj, i = decoder.raw_decode(text, i)
            except json.JSONDecodeError:
                return None
            call = parse_call(obj)
            if call is None:
                return None
            calls.append(call)


class Mistral(ToolFormat):
    name, start = "mistral", "[TOOL_CALLS]"

    def parser(self, tools, id_prefix):
        return WholeCallsParser(self, tools, id_prefix)

    def how_to_call(self) -> str:
        return (
            f"To call functions, answer {self.start} followed by a JSON list of calls, "
            'each {"name": "<function name>", "arguments": {<arguments as JSON>}}.'
        )

    def render_call(self, name, arguments):
        return self.start + json.dumps([{"name": name, "arguments": arguments}])

    def grammar(self, tools):
        return f'start: {self._marker_rule} "[" call "]"\n' + self._json_call(tools)

    def parse(self, region: str, tools) -> list[tuple[str, dict]] | None:
        calls = []
        for part in filter(str.strip, region.split(self.start)):
            if "[ARGS]" in part:  # the newer spelling: name[ARGS]{...}
                name, _, args = part.partition("[ARGS]")
                call = parse_call({"name": name.strip(), "arguments": _json(args)})
                found = [call] if call is not None else None
            else:
                listed = _json(part)
                listed = listed if isinstance(listed, list) else [listed]
                found = [parse_call(c) for c in listed]
            if not found or None in found:
                return None
            calls += found
        return calls or None


class Qwen3Coder(ToolFormat):
    name = "qwen3_coder"
    _FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
    _PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)

    def parser(self, tools, id_prefix):
        return WholeCallsParser(self, tools, id_prefix)

    def how_to_call(self) -> str:
        return (
            "To call a function, answer in this form, one block per call:\n"
            f"{OPEN}\n<function=FUNCTION NAME>\n<parameter=PARAMETER NAME>\nVALUE\n"
            f"</parameter>\n</function>\n{CLOSE}"
        )

    def render_call(self, name, arguments):
        params = "".join(
            f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
            for k, v in arguments.items()
        )
        return f"{OPEN}\n<function={name}>\n{params}</function>\n{CLOSE}"

    def grammar(self, tools):
        """One call of one tool, each of its parameters at most once in declared order,
        the required ones present. A string is one line of text without "<" (up to its
        maxLength, else MAX_TEXT characters); any other value is JSON valid against its
        schema."""
        rules, options = [], []
        for i, t in enumerate(tools):
            props = t.parameters.get("properties", {})
            required = set(t.parameters.get("required", []))
            parts = []
            for j, (k, schema) in enumerate(props.items()):
                value = f"v{i}_{j}"
                rules.append(f"{value}: {_value_rule(schema)}")
                rule = f'"<parameter={k}>\\n" {value} "\\n</parameter>\\n"'
                parts.append(rule if k in required else f"({rule})?")
            rules.append(f'tool{i}: "<function={t.name}>\\n" {" ".join(parts)} "</function>"')
            options.append(f"tool{i}")
        start = f'start: {self._marker_rule} "\\n" ({" | ".join(options)}) "\\n{CLOSE}"'
        return "\n".join([start, *rules]) + "\n"

    def parse(self, region: str, tools) -> list[tuple[str, dict]] | None:
        types = {t.name: t.parameters.get("properties", {}) for t in tools}
        calls = []
        for name, body in self._FUNCTION.findall(region):
            props = types.get(name.strip(), {})
            args = {}
            for key, value in self._PARAMETER.findall(body):
                kind = props.get(key, {}).get("type") if isinstance(props.get(key), dict) else None
                args[key] = value if kind == "string" else _json(value, default=value)
            calls.append((name.strip(), args))
        return calls or None


class DeepSeekV3(ToolFormat):
    """DeepSeek R1's and V3's calls: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function
    <｜tool▁sep｜>NAME, then the arguments in a ```json block (R1, V3), or NAME<｜tool▁sep｜>
    and the arguments bare (V3.1); each call ended by <｜tool▁call▁end｜>."""

    name, start = "deepseek_v3", "<｜tool▁calls▁begin｜>"
    _CALL = re.compile(
        r"<｜tool▁call▁begin｜>\s*(?:function\s*<｜tool▁sep｜>\s*([^\n`<]+?)\s*```(?:json)?\s*"
        r"(.*?)\s*```|([^<]+?)\s*<｜tool▁sep｜>\s*(.*?))\s*<｜tool▁call▁end｜>", re.S
    )
    _MARKERS = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
                "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>")  # fmt: skip

    def __init__(self, tokenizer=None):
        super().__init__(tokenizer)
        self._rules = [_terminal(tokenizer, m)[1] for m in self._MARKERS]

    def parser(self, tools, id_prefix):
        return WholeCallsParser(self, tools, id_prefix)

    def render_call(self, name, arguments):
        calls, call, sep, end, calls_end = self._MARKERS
        return (f"{calls}{call}function{sep}{name}\n```json\n{json.dumps(arguments)}\n```"
                f"{end}{calls_end}")  # fmt: skip

    def grammar(self, tools):
        calls, call, sep, end, calls_end = self._rules
        rules, options = [], []
        for i, t in enumerate(tools):
            schema = close_objects(t.parameters) | {"x-guidance": JSON_OPTIONS}
            rules.append(f"args{i}: %json {json.dumps(schema)}")
            options.append(f'{call} "function" {sep} "{t.name}\\n```json\\n" args{i} '
                           f'"\\n```" {end}')  # fmt: skip
        return (f"start: {calls} ({' | '.join(options)}) {calls_end}\n" + "\n".join(rules)
                + "\n")  # fmt: skip

    def parse(self, region: str, tools) -> list[tuple[str, dict]] | None:
        calls = []
        for m in self._CALL.finditer(region):
            name = (m.group(1) or m.group(3)).strip()
            args = _json(m.group(2) if m.group(1) is not None else m.group(4))
            if not isinstance(args, dict):
                return None
            calls.append((name, args))
        return calls or None


class DeepSeekDSML(ToolFormat):
    """DeepSeek V3.2's and V4's calls, in DSML:
    <｜DSML｜function_calls> (V4: tool_calls) <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="KEY" string="true">text</｜DSML｜parameter>, a value that is not
    a string written as JSON with string="false"."""

    name, start = "deepseek_v32", "<｜DSML｜"
    _INVOKE = re.compile(r'<｜DSML｜invoke name="([^"]+)">(.*?)</｜DSML｜invoke>', re.S)
    _PARAMETER = re.compile(
        r'<｜DSML｜parameter name="([^"]+)"(?: string="(true|false)")?>(.*?)</｜DSML｜parameter>',
        re.S,
    )

    def __init__(self, tokenizer=None, wrapper: str = "function_calls"):
        super().__init__(tokenizer)
        self.wrapper = wrapper

    def parser(self, tools, id_prefix):
        return WholeCallsParser(self, tools, id_prefix)

    def render_call(self, name, arguments):
        params = "".join(
            f'<｜DSML｜parameter name="{k}" string="{str(isinstance(v, str)).lower()}">'
            f"{v if isinstance(v, str) else json.dumps(v)}</｜DSML｜parameter>\n"
            for k, v in arguments.items()
        )
        w = self.wrapper
        return (f'<｜DSML｜{w}>\n<｜DSML｜invoke name="{name}">\n{params}</｜DSML｜invoke>\n'
                f"</｜DSML｜{w}>")  # fmt: skip

    def grammar(self, tools):
        """One call, every parameter written as JSON (string="false"), required ones
        present, each at most once in declared order."""
        rules, options = [], []
        for i, t in enumerate(tools):
            required = set(t.parameters.get("required", []))
            parts = []
            for j, (k, schema) in enumerate(t.parameters.get("properties", {}).items()):
                value = close_objects(schema if isinstance(schema, dict) else {})
                rules.append(f"v{i}_{j}: %json {json.dumps(value | {'x-guidance': JSON_OPTIONS})}")
                rule = (f'"<｜DSML｜parameter name=\\"{k}\\" string=\\"false\\">" v{i}_{j} '
                        f'"</｜DSML｜parameter>\\n"')  # fmt: skip
                parts.append(rule if k in required else f"({rule})?")
            options.append(f'"<｜DSML｜invoke name=\\"{t.name}\\">\\n" {" ".join(parts)} '
                           f'"</｜DSML｜invoke>\\n"')  # fmt: skip
        w = self.wrapper
        start = (f'start: "<｜DSML｜{w}>\\n" ({" | ".join(options)}) "</｜DSML｜{w}>"')
        return "\n".join([start, *rules]) + "\n"

    def parse(self, region: str, tools) -> list[tuple[str, dict]] | None:
        calls = []
        for name, body in self._INVOKE.findall(region):
            args = {}
            for key, string, value in self._PARAMETER.findall(body):
                args[key] = value if string == "true" else _json(value, default=value)
            calls.append((name.strip(), args))
        return calls or None


MAX_TEXT = 256  # characters of a forced qwen3_coder string without a maxLength


def _value_rule(schema) -> str:
    if not isinstance(schema, dict):
        schema = {}
    if schema.get("type") == "string":
        return f"/[^<\\n]{{1,{min(int(schema.get('maxLength', MAX_TEXT)), MAX_TEXT)}}}/"
    return f"%json {json.dumps(close_objects(schema) | {'x-guidance': JSON_OPTIONS})}"


def _json(text: str, default=None):
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
        i = self._buf.find(self.fmt.start)
        if i >= 0:
            text, self._buf, self._in_calls = self._buf[:i], self._buf[i:], True
            return [("text", text)] if text else []
        keep = partial_suffix(self._buf, self.fmt.start)
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


class Harmony(ToolFormat):
    name, start = "harmony", CHANNEL
    channels = True  # the format's parser reads the whole answer: thinking, text and calls
    _MARKERS = (CHANNEL, CONSTRAIN, MESSAGE, "<|call|>")

    def __init__(self, tokenizer=None):
        super().__init__(tokenizer)
        self.special_marker = True  # its markers are control tokens the parser must see
        self._rules = {m: _terminal(tokenizer, m)[1] for m in self._MARKERS}

    def parser(self, tools: list[Tool], id_prefix: str, reasoning: bool = True):
        return HarmonyParser(id_prefix, reasoning)

    def describe(self, tools: list[Tool]) -> str:
        return "\n".join(json.dumps(t.as_openai()) for t in tools)

    def render_call(self, name: str, arguments: dict) -> str:
        return (f"{CHANNEL}commentary to=functions.{name} {CONSTRAIN}json{MESSAGE}"
                f"{json.dumps(arguments)}<|call|>")  # fmt: skip

    def grammar(self, tools: list[Tool]) -> str:
        """One call of one of `tools` on the commentary channel, its arguments valid
        against the tool's schema, ended by <|call|>."""
        r = self._rules
        rules, options = [], []
        for i, t in enumerate(tools):
            schema = close_objects(t.parameters) | {"x-guidance": JSON_OPTIONS}
            rules.append(f"args{i}: %json {json.dumps(schema)}")
            options.append(
                f'{r[CHANNEL]} "commentary to=functions.{t.name} " {r[CONSTRAIN]} "json" '
                f"{r[MESSAGE]} args{i} {r['<|call|>']}"
            )
        return "start: " + " | ".join(options) + "\n" + "\n".join(rules) + "\n"


FORMATS = {f.name: f for f in (ToolFormat, Llama3Json, Mistral, Qwen3Coder, Harmony,
                                DeepSeekV3, DeepSeekDSML)}  # fmt: skip


def resolve(setting: str, template_source: str | None, tokenizer) -> ToolFormat:
    """The format under --tool-call-parser; auto: the one the chat template writes."""
    if setting == "auto":
        source = template_source or ""
        if "<|channel|>" in source:
            setting = "harmony"
        elif "｜DSML｜" in source:
            wrapper = "tool_calls" if "｜DSML｜tool_calls" in source else "function_calls"
            return DeepSeekDSML(tokenizer, wrapper)
        elif "tool▁calls▁begin" in source:
            setting = "deepseek_v3"
        elif "<function=" in source:
            setting = "qwen3_coder"
        elif "[TOOL_CALLS]" in source:
            setting = "mistral"
        elif "<|python_tag|>" in source or "ipython" in source:
            setting = "llama3_json"
        else:
            setting = "hermes"
    return FORMATS[setting](tokenizer)
