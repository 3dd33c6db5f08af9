"""The formats of the families whose calls have a syntax of their own (serve/tool_formats.py
lists them all): DeepSeek's two, Kimi K2's, Command R7B's, Gemma 4's, GLM 4.5's and gpt-oss's
harmony."""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod

from tokenworks.engine.request import JSON_OPTIONS, close_objects
from tokenworks.serve.harmony import CHANNEL, CONSTRAIN, MESSAGE, HarmonyParser
from tokenworks.serve.tool_format_base import (
    ToolFormat,
    WholeCallsParser,
    arguments_rules,
    json_value,
    marker_terminal,
    ordered_arguments,
    value_rule,
)
from tokenworks.serve.tools import CLOSE, OPEN, Tool, parse_call


class _SectionOfCalls(ToolFormat, ABC):
    """Calls between a section's opening and closing markers (the first and last of
    _MARKERS), each call's arguments one JSON object, read whole."""

    _MARKERS: tuple[str, ...] = ()

    def __init__(self, tokenizer=None):
        super().__init__(tokenizer)
        self._rules = [marker_terminal(tokenizer, m)[1] for m in self._MARKERS]

    def parser(self, tools, id_prefix):
        return WholeCallsParser(self, tools, id_prefix)

    @abstractmethod
    def _call(self, name: str, args: str) -> str:
        """The grammar of one call of `name` whose arguments are the rule `args`."""

    def grammar(self, tools):
        options = [self._call(t.name, f"args{i}") for i, t in enumerate(tools)]
        opening, closing = self._rules[0], self._rules[-1]
        rules = "\n".join(arguments_rules(tools))
        return f"start: {opening} ({' | '.join(options)}) {closing}\n{rules}\n"


class DeepSeekV3(_SectionOfCalls):
    """DeepSeek R1's and V3's calls: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function
    <｜tool▁sep｜>NAME, then the arguments in a ```json block (R1, V3), or NAME<｜tool▁sep｜>
    and the arguments bare (V3.1); each call ended by <｜tool▁call▁end｜>. Hermes's
    <tool_call> blocks are read too (R1's Qwen distills write them)."""

    name, start = "deepseek_v3", "<｜tool▁calls▁begin｜>"
    _CALL = re.compile(
        r"<｜tool▁call▁begin｜>\s*(?:function\s*<｜tool▁sep｜>\s*([^\n`<]+?)\s*```(?:json)?\s*"
        r"(.*?)\s*```|([^<]+?)\s*<｜tool▁sep｜>\s*(.*?))\s*<｜tool▁call▁end｜>", re.S
    )
    starts = (start, OPEN)
    _HERMES = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)
    _MARKERS = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
                "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>")  # fmt: skip

    def render_call(self, name, arguments):
        calls, call, sep, end, calls_end = self._MARKERS
        return (f"{calls}{call}function{sep}{name}\n```json\n{json.dumps(arguments)}\n```"
                f"{end}{calls_end}")  # fmt: skip

    def _call(self, name: str, args: str) -> str:
        _, call, sep, end, _ = self._rules
        return f'{call} "function" {sep} "{name}\\n```json\\n" {args} "\\n```" {end}'

    def parse(self, region: str, tools) -> list[tuple[str, dict]] | None:
        calls = []
        for m in self._CALL.finditer(region):
            name = (m.group(1) or m.group(3)).strip()
            args = json_value(m.group(2) if m.group(1) is not None else m.group(4))
            if not isinstance(args, dict):
                return None
            calls.append((name, args))
        if not calls:  # R1's Qwen distills may write Qwen's own calls
            calls = [parse_call(json_value(body)) for body in self._HERMES.findall(region)]
            calls = calls if None not in calls else []
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
                args[key] = value if string == "true" else json_value(value, default=value)
            calls.append((name.strip(), args))
        return calls or None


class KimiK2(_SectionOfCalls):
    """Kimi K2's calls: <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:INDEX
    <|tool_call_argument_begin|>{...}<|tool_call_end|> ... <|tool_calls_section_end|>."""

    name, start = "kimi_k2", "<|tool_calls_section_begin|>"
    starts = (start, "<|tool_call_begin|>")  # (a model may leave out the section's markers)
    _CALL = re.compile(  # (a call may end where the next begins, or at the end)
        r"<\|tool_call_begin\|>\s*(?:functions\.)?([^:<\s]+)(?::\d+)?\s*"
        r"<\|tool_call_argument_begin\|>(.*?)(?:<\|tool_call_end\|>|"
        r"(?=<\|tool_call_begin\|>)|<\|tool_calls_section_end\|>|$)", re.S
    )
    _MARKERS = ("<|tool_calls_section_begin|>", "<|tool_call_begin|>",
                "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|tool_calls_section_end|>")

    def render_call(self, name, arguments):
        section, call, args, end, section_end = self._MARKERS
        return f"{section}{call}functions.{name}:0{args}{json.dumps(arguments)}{end}{section_end}"

    def _call(self, name: str, args: str) -> str:
        _, call, begin, end, _ = self._rules
        return f'{call} "functions.{name}:0" {begin} {args} {end}'

    def parse(self, region: str, tools) -> list[tuple[str, dict]] | None:
        calls = []
        for name, body in self._CALL.findall(region):
            args = json_value(body)
            if not isinstance(args, dict):
                return None
            calls.append((name, args))
        return calls or None


class CommandR7B(_SectionOfCalls):
    """Command R7B's and Cohere2's calls: <|START_ACTION|>[{"tool_call_id": "0", "tool_name":
    NAME, "parameters": {...}}, ...]<|END_ACTION|>; their answer's text comes between
    <|START_RESPONSE|> and <|END_RESPONSE|> (Cohere2: <|START_TEXT|>, <|END_TEXT|>)."""

    name, start = "command_r7b", "<|START_ACTION|>"
    answer_markers = ("<|START_RESPONSE|>", "<|END_RESPONSE|>", "<|START_TEXT|>", "<|END_TEXT|>")
    _MARKERS = ("<|START_ACTION|>", "<|END_ACTION|>")

    def how_to_call(self) -> str:
        return (
            f"To call functions, answer {self.start} followed by a JSON list of calls, each "
            '{"tool_call_id": "<its index>", "tool_name": "<function name>", "parameters": '
            f"{{<arguments as JSON>}}}}, then {self._MARKERS[1]}."
        )

    def render_call(self, name, arguments):
        call = {"tool_call_id": "0", "tool_name": name, "parameters": arguments}
        return f"{self.start}[\n    {json.dumps(call)}\n]{self._MARKERS[1]}"

    def _call(self, name: str, args: str) -> str:
        head = f'[\n    {{"tool_call_id": "0", "tool_name": {json.dumps(name)}, "parameters": '
        return f"{json.dumps(head)} {args} {json.dumps('}' + chr(10) + ']')}"

    def parse(self, region: str, tools) -> list[tuple[str, dict]] | None:
        calls = []
        for section in filter(str.strip, region.split(self.start)):
            listed = json_value(self._listed(section))
            if not isinstance(listed, list):
                return None
            for call in listed:
                if not isinstance(call, dict) or not isinstance(call.get("parameters"), dict):
                    return None
                calls.append((str(call.get("tool_name", "")), call["parameters"]))
        return calls or None

    def _listed(self, section: str) -> str:
        """A section's JSON list of calls, without what ends it."""
        return section.split(self._MARKERS[1])[0].strip()


class CommandR(CommandR7B):
    """Command R+'s calls: Action: and a ```json block listing {"tool_name": NAME,
    "parameters": {...}}; its answer comes after <|CHATBOT_TOKEN|>."""

    name, start = "command_r", "Action:"
    answer_markers = ("<|CHATBOT_TOKEN|>", "<|END_OF_TURN_TOKEN|>")
    _MARKERS = ("Action:\n```json\n", "\n```")

    def how_to_call(self) -> str:
        return (
            'To call functions, answer "Action:" and a ```json block holding a JSON list of '
            'calls, each {"tool_name": "<function name>", "parameters": {<arguments as JSON>}}.'
        )

    def render_call(self, name, arguments):
        listed = json.dumps([{"tool_name": name, "parameters": arguments}])
        return f"{self._MARKERS[0]}{listed}{self._MARKERS[1]}"

    def _call(self, name: str, args: str) -> str:
        head = '[{"tool_name": ' + json.dumps(name) + ', "parameters": '
        return f'{json.dumps(head)} {args} "}}]"'

    def _listed(self, section: str) -> str:
        return section.strip().removeprefix("```json").split("```")[0].strip()


class Gemma4(ToolFormat):
    """Gemma 4's calls: <|tool_call>call:NAME{key:value,...}<tool_call|>, its values written
    as JSON's but with bare keys and strings between <|"|> marks. Where thinking is parsed,
    the thinking channel's stray markers left in an answer are not part of it."""

    name, start, end, quote = "gemma4", "<|tool_call>", "<tool_call|>", '<|"|>'
    stray_thinking = ("<|channel>thought\n<channel|>", "<|channel>", "<channel|>")
    _CALL = re.compile(r"<\|tool_call>call:([^{<\s]+)(\{.*?\})<tool_call\|>", re.S)

    def __init__(self, tokenizer=None):
        super().__init__(tokenizer)
        self._end = marker_terminal(tokenizer, self.end)[1]
        self._quote = marker_terminal(tokenizer, self.quote)[1]

    def parser(self, tools, id_prefix):
        return WholeCallsParser(self, tools, id_prefix)

    def how_to_call(self) -> str:
        return (f"To call a function, answer {self.start}call:NAME{{key:value,...}}{self.end}, "
                f"strings between {self.quote} marks.")  # fmt: skip

    def _value(self, v) -> str:
        if isinstance(v, str):
            return f"{self.quote}{v}{self.quote}"
        if isinstance(v, dict):
            return "{" + ",".join(f"{k}:{self._value(x)}" for k, x in v.items()) + "}"
        if isinstance(v, list):
            return "[" + ",".join(self._value(x) for x in v) + "]"
        return json.dumps(v)

    def render_call(self, name, arguments):
        return f"{self.start}call:{name}{self._value(arguments)}{self.end}"

    def grammar(self, tools):
        """One call, the required parameters in declared order and then the optional ones,
        each at most once; strings as text without "<" between quote marks, other values as
        JSON."""
        rules, options = [], []
        for i, t in enumerate(tools):
            props = t.parameters.get("properties", {})
            required = set(t.parameters.get("required", []))
            pairs = {}
            for j, (k, schema) in enumerate(props.items()):
                string = isinstance(schema, dict) and schema.get("type") == "string"
                rules.append(f"v{i}_{j}: " + (f"{self._quote} {value_rule(schema)} {self._quote}"
                                              if string else value_rule(schema)))  # fmt: skip
                pairs[k] = f'"{k}:" v{i}_{j}'
            body = ordered_arguments(pairs, required, '","')
            options.append(f'"call:{t.name}{{" {body} "}}"')
        return (f"start: {self._marker_rule} ({' | '.join(options)}) {self._end}\n"
                + "\n".join(rules) + "\n")  # fmt: skip

    def parse(self, region: str, tools) -> list[tuple[str, dict]] | None:
        calls = []
        for name, body in self._CALL.findall(region):
            try:
                args, end = self._read(body, 0)
            except (ValueError, IndexError):
                return None
            if not isinstance(args, dict) or body[end:].strip():
                return None
            calls.append((name, args))
        return calls or None

    def _read(self, text: str, i: int):
        """The value at text[i:] and where it ends."""
        while text[i] in " \n\t":
            i += 1
        if text.startswith(self.quote, i):
            j = text.index(self.quote, i + len(self.quote))
            return text[i + len(self.quote) : j], j + len(self.quote)
        if text[i] in "{[":
            close, out = ("}", {}) if text[i] == "{" else ("]", [])
            i += 1
            while True:
                while text[i] in " \n\t,":
                    i += 1
                if text[i] == close:
                    return out, i + 1
                if close == "}":
                    colon = text.index(":", i)
                    key = text[i:colon].strip().strip('"')
                    out[key], i = self._read(text, colon + 1)
                else:
                    value, i = self._read(text, i)
                    out.append(value)
        j = i
        while j < len(text) and text[j] not in ",}]":
            j += 1
        word = text[i:j].strip()
        return json.loads(word) if word[:1] != '"' or word[-1:] == '"' else word, j


class GLM45(ToolFormat):
    """GLM 4.5 to 4.7's calls: <tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE
    </arg_value>...</tool_call>, a value whose parameter is a string written bare, any
    other as JSON."""

    name = "glm45"
    _CALL = re.compile(r"<tool_call>\s*([^<\n]+?)\s*(<arg_key>.*?)?</tool_call>", re.S)
    _ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)

    def parser(self, tools, id_prefix):
        return WholeCallsParser(self, tools, id_prefix)

    def render_call(self, name, arguments):
        args = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>"
                       f"{v if isinstance(v, str) else json.dumps(v)}</arg_value>\n"
                       for k, v in arguments.items())  # fmt: skip
        return f"{OPEN}{name}\n{args}{CLOSE}"

    def grammar(self, tools):
        """One call, each parameter at most once in declared order, the required ones
        present; strings as one line of text without "<", other values as JSON."""
        rules, options = [], []
        for i, t in enumerate(tools):
            required = set(t.parameters.get("required", []))
            parts = []
            for j, (k, schema) in enumerate(t.parameters.get("properties", {}).items()):
                rules.append(f"v{i}_{j}: {value_rule(schema)}")
                rule = f'"<arg_key>{k}</arg_key>\\n<arg_value>" v{i}_{j} "</arg_value>\\n"'
                parts.append(rule if k in required else f"({rule})?")
            options.append(f'"{t.name}\\n" {" ".join(parts)}')
        start = f'start: {self._marker_rule} ({" | ".join(options)}) "{CLOSE}"'
        return "\n".join([start, *rules]) + "\n"

    def parse(self, region: str, tools) -> list[tuple[str, dict]] | None:
        types = {t.name: t.parameters.get("properties", {}) for t in tools}
        calls = []
        for name, body in self._CALL.findall(region):
            props = types.get(name.strip(), {})
            args = {}
            for key, value in self._ARG.findall(body or ""):
                kind = props.get(key, {}).get("type") if isinstance(props.get(key), dict) else None
                args[key.strip()] = value if kind == "string" else json_value(value, default=value)
            calls.append((name.strip(), args))
        return calls or None


class Harmony(ToolFormat):
    name, start = "harmony", CHANNEL
    channels = True  # the format's parser reads the whole answer: thinking, text and calls
    _MARKERS = (CHANNEL, CONSTRAIN, MESSAGE, "<|call|>")

    def __init__(self, tokenizer=None):
        super().__init__(tokenizer)
        self.special_marker = True  # its markers are control tokens the parser must see
        self._rules = {m: marker_terminal(tokenizer, m)[1] for m in self._MARKERS}

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
        options = [
            f'{r[CHANNEL]} "commentary to=functions.{t.name} " {r[CONSTRAIN]} "json" '
            f"{r[MESSAGE]} args{i} {r['<|call|>']}"
            for i, t in enumerate(tools)
        ]
        return "start: " + " | ".join(options) + "\n" + "\n".join(arguments_rules(tools)) + "\n"
