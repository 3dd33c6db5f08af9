"""Tool calls written as a Python list of calls (serve/tool_formats.py lists the formats):
LFM2's <|tool_call_start|>[get_time(city="Paris"), ...]<|tool_call_end|>. The list is read
by Python's own parser and its values taken as literals; nothing in it is run."""

from __future__ import annotations

import ast
import json

from tokenworks.engine.request import JSON_OPTIONS, close_objects
from tokenworks.serve.tool_format_base import (
    ToolFormat,
    WholeCallsParser,
    marker_terminal,
    ordered_arguments,
)

# JSON's spellings, which models write as often as Python's
_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


def literal(node: ast.AST):
    """A value of the call list: a constant, a list, a dict, or a name of JSON's or Python's
    for true, false and null; anything else (a call, an operation) is refused."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        value = literal(node.operand)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return -value
    if isinstance(node, ast.List | ast.Tuple):
        return [literal(x) for x in node.elts]
    if isinstance(node, ast.Dict) and None not in node.keys:
        return {literal(k): literal(v) for k, v in zip(node.keys, node.values, strict=True)}
    raise ValueError(f"not a literal: {ast.dump(node)[:60]}")


class PythonCalls(ToolFormat):
    """LFM2's calls: a Python list of calls with keyword arguments between its markers."""

    name, start, end = "lfm2", "<|tool_call_start|>", "<|tool_call_end|>"

    def __init__(self, tokenizer=None):
        super().__init__(tokenizer)
        self._end = marker_terminal(tokenizer, self.end)[1]

    def parser(self, tools, id_prefix):
        return WholeCallsParser(self, tools, id_prefix)

    def how_to_call(self) -> str:
        return (f"To call functions, answer {self.start}[name(key=value, ...), ...]{self.end}, "
                "values written as Python literals.")  # fmt: skip

    def render_call(self, name, arguments):
        args = ", ".join(f"{k}={json.dumps(v)}" for k, v in arguments.items())
        return f"{self.start}[{name}({args})]{self.end}"

    def grammar(self, tools):
        """One call, its required arguments in declared order and then the optional ones,
        each value as JSON valid against its schema (which Python reads too, but for true,
        false and null, read here as literals)."""
        rules, options = [], []
        for i, t in enumerate(tools):
            props = t.parameters.get("properties", {})
            required = set(t.parameters.get("required", []))
            pairs = {}
            for j, (k, schema) in enumerate(props.items()):
                value = close_objects(schema if isinstance(schema, dict) else {})
                rules.append(f"v{i}_{j}: %json {json.dumps(value | {'x-guidance': JSON_OPTIONS})}")
                pairs[k] = f'"{k}=" v{i}_{j}'
            body = ordered_arguments(pairs, required, '", "')
            options.append(f'"{t.name}(" {body} ")"')
        start = f'start: {self._marker_rule} "[" ({" | ".join(options)}) "]" {self._end}'
        return "\n".join([start, *rules]) + "\n"

    def parse(self, region: str, tools) -> list[tuple[str, dict]] | None:
        calls = []
        for section in filter(str.strip, region.split(self.start)):
            try:
                listed = ast.parse(section.split(self.end)[0].strip(), mode="eval").body
                if not isinstance(listed, ast.List):
                    return None
                for call in listed.elts:
                    if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name):
                        return None
                    if call.args:
                        return None
                    calls.append((call.func.id, {kw.arg: literal(kw.value)
                                                 for kw in call.keywords}))  # fmt: skip
            except (SyntaxError, ValueError, RecursionError):
                return None
        return calls or None
