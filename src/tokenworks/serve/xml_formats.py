"""The formats whose calls are XML elements or tags like them (serve/tool_formats.py lists
them all): MiniMax M2's and M3's and MiniCPM 5's, typed by the tool's schema, and Kimi K3's.

A value is read as its parameter's schema allows: kept as the element's text where a string
is allowed, else its child elements as an object (a list where they are all <item>s), else
its text as JSON (a number, true, false, null), or as text where it is not JSON."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from tokenworks.serve.tool_format_base import (
    ToolFormat,
    WholeCallsParser,
    json_value,
    marker_terminal,
    value_rule,
)

_CDATA = re.compile(r"<!\[CDATA\[(.*?)\]\]>", re.S)


@dataclass
class Element:
    name: str
    attrs: dict
    inner: str  # the text between its tags, as written
    children: list[Element] = field(default_factory=list)


def elements(text: str, tag: re.Pattern) -> list[Element]:
    """The elements of text, nested; `tag` matches a tag with groups (slash, name, attrs)."""
    root = Element("", {}, text)
    stack: list[tuple[Element, int]] = [(root, 0)]
    cdata = [m.span() for m in _CDATA.finditer(text)]  # (tags inside are text)
    for m in tag.finditer(text):
        if any(a <= m.start() < b for a, b in cdata):
            continue
        closing, name, attrs = m.group(1), m.group(2), m.group(3) or ""
        if not closing:
            found = Element(name, dict(re.findall(r'(\w+)="([^"]*)"', attrs)), "")
            stack[-1][0].children.append(found)
            stack.append((found, m.end()))
        elif len(stack) > 1 and stack[-1][0].name == name:
            done, start = stack.pop()
            done.inner = text[start : m.start()]
    return root.children


def _members(schema) -> list[dict]:
    if not isinstance(schema, dict):
        return [{}]
    listed = schema.get("anyOf") or schema.get("oneOf")
    return [s for s in listed if isinstance(s, dict)] if listed else [schema]


def _types(schema) -> set:
    out = set()
    for s in _members(schema):
        t = s.get("type")
        out |= set(t) if isinstance(t, list) else {t} if t else set()
    return out


def typed(element: Element, schema, bare) -> object:
    """element's value under schema; bare: its inner text without the format's markup."""
    kinds = _types(schema)
    if "string" in kinds:
        whole = _CDATA.fullmatch(element.inner.strip())
        return whole.group(1) if whole else element.inner
    if element.children:
        items = all(c.name == "item" for c in element.children)
        if items and ("array" in kinds or "object" not in kinds):
            items = next((s.get("items", {}) for s in _members(schema) if "items" in s), {})
            return [typed(c, items, bare) for c in element.children]
        props = next((s["properties"] for s in _members(schema) if "properties" in s), {})
        return {c.name: typed(c, props.get(c.name, {}), bare) for c in element.children}
    text = bare(element.inner).strip()
    return json_value(text, default=text)


class MiniMaxM2(ToolFormat):
    """MiniMax M2's calls: <minimax:tool_call><invoke name="NAME"><parameter name="KEY">
    VALUE</parameter>...</invoke></minimax:tool_call>."""

    name, start, end = "minimax_m2", "<minimax:tool_call>", "</minimax:tool_call>"
    _stops = "<\\n"  # what a forced string stops before: the markup after it
    _call_tag, _param_tag = "invoke", "parameter"
    _TAG = re.compile(r"<(/?)(invoke|parameter)((?:\s+\w+=\"[^\"]*\")*)\s*>")

    def __init__(self, tokenizer=None):
        super().__init__(tokenizer)
        self._end = marker_terminal(tokenizer, self.end)[1]

    def parser(self, tools, id_prefix):
        return WholeCallsParser(self, tools, id_prefix)

    def how_to_call(self) -> str:
        return (f'To call a function, answer {self.start}\n<invoke name="NAME">\n<parameter '
                f'name="KEY">VALUE</parameter>\n</invoke>\n{self.end}')  # fmt: skip

    def _value(self, v) -> str:
        return v if isinstance(v, str) else json.dumps(v)

    def render_call(self, name, arguments):
        params = "".join(f'<parameter name="{k}">{self._value(v)}</parameter>\n'
                         for k, v in arguments.items())  # fmt: skip
        return f'{self.start}\n<invoke name="{name}">\n{params}</invoke>\n{self.end}'

    def _pair(self, key: str, value: str) -> str:
        return f'"<parameter name=\\"{key}\\">" {value} "</parameter>\\n"'

    def _invoke(self, name: str, body: str) -> str:
        return f'"\\n<invoke name=\\"{name}\\">\\n" {body} "</invoke>\\n"'

    def grammar(self, tools):
        """One call, the required parameters present, each at most once in declared order;
        strings as text without "<", other values as JSON."""
        rules, options = [], []
        for i, t in enumerate(tools):
            required = set(t.parameters.get("required", []))
            parts = []
            for j, (k, schema) in enumerate(t.parameters.get("properties", {}).items()):
                rules.append(f"v{i}_{j}: {value_rule(schema, self._stops)}")
                pair = self._pair(k, f"v{i}_{j}")
                parts.append(pair if k in required else f"({pair})?")
            options.append(self._invoke(t.name, " ".join(parts)))
        return "\n".join([f"start: {self._around(' | '.join(options))}", *rules]) + "\n"

    def _around(self, options: str) -> str:
        """The grammar of the calls' section around the options of one call."""
        return f"{self._marker_rule} ({options}) {self._end}"

    def _bare(self, text: str) -> str:
        return text

    def _arguments(self, invoke: Element, props: dict) -> dict:
        return {p.attrs.get("name", ""): typed(p, props.get(p.attrs.get("name"), {}), self._bare)
                for p in invoke.children if p.name == self._param_tag}  # fmt: skip

    def parse(self, region: str, tools) -> list[tuple[str, dict]] | None:
        types = {t.name: t.parameters.get("properties", {}) for t in tools}
        calls = []
        found = elements(region, self._TAG)  # (M3's <tool_call> is an element too)
        call = self._call_tag
        invokes = [e for top in found for e in ([top] if top.name == call else top.children)]
        for invoke in invokes:
            if invoke.name == self._call_tag and "name" in invoke.attrs:
                name = invoke.attrs["name"]
                calls.append((name, self._arguments(invoke, types.get(name, {}))))
        return calls or None


class MiniCPM5(MiniMaxM2):
    """MiniCPM 5's calls: <function name="NAME"><param name="KEY">VALUE</param>...
    </function>, a value holding markup written in CDATA."""

    name, start = "minicpm5", '<function name="'
    _TAG = re.compile(r"<(/?)(function|param)((?:\s+\w+=\"[^\"]*\")*)\s*>")
    _call_tag, _param_tag = "function", "param"

    def __init__(self, tokenizer=None):
        super().__init__(tokenizer)
        self._marker_rule = self._end = ""  # (the call is its own start and end)

    def how_to_call(self) -> str:
        return ('To call a function, answer <function name="NAME"><param name="KEY">VALUE'
                "</param></function>")

    def render_call(self, name, arguments):
        params = "".join(f'<param name="{k}">{self._value(v)}</param>'
                         for k, v in arguments.items())  # fmt: skip
        return f'<function name="{name}">{params}</function>'

    def _pair(self, key: str, value: str) -> str:
        return f'"<param name=\\"{key}\\">" {value} "</param>"'

    def _invoke(self, name: str, body: str) -> str:
        return f'"<function name=\\"{name}\\">" {body} "</function>"'


class MiniMaxM3(MiniMaxM2):
    """MiniMax M3's calls: every tag marked by ]<]minimax[>[ before it:
    <tool_call>\\n<invoke name="NAME"><KEY>VALUE</KEY>...</invoke>\\n</tool_call>, an object's
    fields as elements of their own and a list's entries as <item>s."""

    NS = "]<]minimax[>["
    name, start, end = "minimax_m3", NS + "<tool_call>", NS + "</tool_call>"
    _stops = "<\\]\\n"
    _TAG = re.compile(r"\]<\]minimax\[>\[<(/?)([A-Za-z_][\w.-]*)((?:\s+\w+=\"[^\"]*\")*)\s*>")

    def how_to_call(self) -> str:
        ns = self.NS
        return (f'To call a function, answer {self.start}\n{ns}<invoke name="NAME">{ns}<KEY>'
                f"VALUE{ns}</KEY>{ns}</invoke>\n{self.end}")  # fmt: skip

    def render_call(self, name, arguments):
        ns = self.NS
        params = "".join(f"{ns}<{k}>{self._value(v)}{ns}</{k}>" for k, v in arguments.items())
        return f'{self.start}\n{ns}<invoke name="{name}">{params}{ns}</invoke>\n{self.end}'

    def _pair(self, key: str, value: str) -> str:
        ns = json.dumps(self.NS)[1:-1]
        return f'"{ns}<{key}>" {value} "{ns}</{key}>"'

    def _invoke(self, name: str, body: str) -> str:
        ns = json.dumps(self.NS)[1:-1]
        return f'"\\n{ns}<invoke name=\\"{name}\\">" {body} "{ns}</invoke>\\n"'

    def _bare(self, text: str) -> str:
        return text.replace(self.NS, "")

    def _arguments(self, invoke: Element, props: dict) -> dict:
        return {p.name: typed(p, props.get(p.name, {}), self._bare) for p in invoke.children}


class KimiK3(ToolFormat):
    """Kimi K3's calls, in its tags <|open|>NAME attrs<|sep|> ... <|close|>NAME<|sep|>:
    tools, then call tool="NAME" index="I", then argument key="KEY" type="TYPE" around each
    value (a string as written, any other type as JSON); its answer is wrapped in response
    and ended by message, which are not part of it."""

    name, start = "kimi_k3", "<|open|>tools<|sep|>"
    OPEN, SEP, CLOSE = "<|open|>", "<|sep|>", "<|close|>"
    answer_markers = ("<|open|>response<|sep|>", "<|close|>response<|sep|>",
                      "<|close|>message<|sep|>")  # fmt: skip
    _CALL = re.compile(r'<\|open\|>call tool="([^"]*)"[^<]*<\|sep\|>(.*?)<\|close\|>call<\|sep\|>',
                       re.S)  # fmt: skip
    _ARG = re.compile(r'<\|open\|>argument key="([^"]*)" type="([^"]*)"<\|sep\|>(.*?)'
                      r"<\|close\|>argument<\|sep\|>", re.S)  # fmt: skip
    _TYPES = {"string": "string", "integer": "number", "number": "number", "boolean": "boolean",
              "object": "object", "array": "array", "null": "null"}  # fmt: skip

    def __init__(self, tokenizer=None):
        super().__init__(tokenizer)
        self._o, self._s, self._c = (marker_terminal(tokenizer, m)[1]
                                     for m in (self.OPEN, self.SEP, self.CLOSE))  # fmt: skip

    def parser(self, tools, id_prefix):
        return WholeCallsParser(self, tools, id_prefix)

    def how_to_call(self) -> str:
        o, s, c = self.OPEN, self.SEP, self.CLOSE
        return (f'To call a function, answer {self.start}{o}call tool="NAME" index="1"{s}{o}'
                f'argument key="KEY" type="TYPE"{s}VALUE{c}argument{s}{c}call{s}{c}tools{s}')

    @staticmethod
    def _type(v) -> str:
        if isinstance(v, bool):
            return "boolean"
        if v is None:
            return "null"
        if isinstance(v, int | float):
            return "number"
        return {str: "string", dict: "object"}.get(type(v), "array")

    def render_call(self, name, arguments):
        o, s, c = self.OPEN, self.SEP, self.CLOSE
        args = "".join(f'{o}argument key="{k}" type="{self._type(v)}"{s}'
                       f"{v if isinstance(v, str) else json.dumps(v)}{c}argument{s}"
                       for k, v in arguments.items())  # fmt: skip
        return f'{self.start}{o}call tool="{name}" index="1"{s}{args}{c}call{s}{c}tools{s}'

    def grammar(self, tools):
        """One call, the required arguments present, each at most once in declared order;
        strings as text without "<", other values as JSON."""
        o, s, c = self._o, self._s, self._c
        rules, options = [], []
        for i, t in enumerate(tools):
            required = set(t.parameters.get("required", []))
            parts = []
            for j, (k, schema) in enumerate(t.parameters.get("properties", {}).items()):
                kind = self._TYPES.get(schema.get("type") if isinstance(schema, dict) else None,
                                       "object")  # fmt: skip
                rules.append(f"v{i}_{j}: {value_rule(schema)}")
                arg = (f'{o} "argument key=\\"{k}\\" type=\\"{kind}\\"" {s} v{i}_{j} {c} '
                       f'"argument" {s}')  # fmt: skip
                parts.append(arg if k in required else f"({arg})?")
            options.append(f'{o} "call tool=\\"{t.name}\\" index=\\"1\\"" {s} {" ".join(parts)} '
                           f'{c} "call" {s}')  # fmt: skip
        start = f'start: {o} "tools" {s} ({" | ".join(options)}) {c} "tools" {s}'
        return "\n".join([start, *rules]) + "\n"

    def parse(self, region: str, tools) -> list[tuple[str, dict]] | None:
        calls = []
        for name, body in self._CALL.findall(region):
            args = {}
            for key, kind, value in self._ARG.findall(body):
                args[key] = value if kind == "string" else json_value(value, default=value)
            calls.append((name, args))
        return calls or None
