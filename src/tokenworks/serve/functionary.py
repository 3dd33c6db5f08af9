"""Functionary's two formats (serve/tool_formats.py lists them all).

v3.1 writes each call as <function=NAME>{arguments as JSON}</function>. v3.2 writes every
part of its answer after a recipient line: >>>all and then text for the user, >>>NAME and
then a call's JSON arguments; its chat template ends the prompt with the first >>>, so the
output starts at the recipient.
"""

from __future__ import annotations

import json
import re

from tokenworks.serve.tool_format_base import (
    ToolFormat,
    WholeCallsParser,
    arguments_rules,
    json_value,
)
from tokenworks.serve.tools import Tool, ToolCall, new_call_id, partial_suffix


class FunctionaryV31(ToolFormat):
    name, start, end = "functionary_v31", "<function=", "</function>"
    _CALL = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)

    def parser(self, tools, id_prefix):
        return WholeCallsParser(self, tools, id_prefix)

    def how_to_call(self) -> str:
        return ("To call a function, answer <function=FUNCTION NAME>{<arguments as JSON>}"
                "</function>, one per call.")  # fmt: skip

    def render_call(self, name, arguments):
        return f"<function={name}>{json.dumps(arguments)}</function>"

    def grammar(self, tools):
        options = " | ".join(f'"<function={t.name}>" args{i}' for i, t in enumerate(tools))
        return f'start: ({options}) "{self.end}"\n' + "\n".join(arguments_rules(tools)) + "\n"

    def parse(self, region: str, tools) -> list[tuple[str, dict]] | None:
        calls = [(name.strip(), json_value(body.strip()))
                 for name, body in self._CALL.findall(region)]  # fmt: skip
        return calls if calls and all(isinstance(a, dict) for _, a in calls) else None


class FunctionaryV32(ToolFormat):
    name, start = "functionary_v32", ">>>"
    channels = True  # its parser reads the whole answer: the recipient comes first
    TEXT = "all"  # the recipient of text for the user

    def parser(self, tools, id_prefix, reasoning: bool = False):
        return RecipientParser(tools, id_prefix, self.start, self.TEXT)

    def how_to_call(self) -> str:
        return (f"Begin each part of your answer with {self.start} and its recipient on a line: "
                f"{self.start}{self.TEXT} for text to the user, {self.start}FUNCTION NAME for a "
                "call, its arguments as JSON on the lines after.")  # fmt: skip

    def render_call(self, name, arguments):
        return f"{self.start}{name}\n{json.dumps(arguments)}"

    def grammar(self, tools):
        """One call, from the recipient on (the prompt wrote the first >>>)."""
        options = " | ".join(f'"{t.name}\\n" args{i}' for i, t in enumerate(tools))
        return f"start: {options}\n" + "\n".join(arguments_rules(tools)) + "\n"


class RecipientParser:
    """Functionary v3.2's answer as it streams: a part for "all" streams as text; a part
    for an offered tool is held and read as its call's JSON arguments when it ends; a part
    for anything else (a model off its format) is text, its recipient line included."""

    MAX_RECIPIENT = 64  # characters: a longer first line is text, not a recipient

    def __init__(self, tools: list[Tool], id_prefix: str, mark: str, text_recipient: str):
        self._names = {t.name for t in tools}
        self._prefix, self._mark, self._all = id_prefix, mark, text_recipient
        self._buf, self._part, self._recipient = "", "recipient", ""
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[tuple[str, object]]:
        self._buf += text
        events: list[tuple[str, object]] = []
        while True:
            if self._part == "recipient":
                if self._buf.startswith(self._mark):
                    self._buf = self._buf[len(self._mark):]
                line, newline, rest = self._buf.partition("\n")
                if not newline:
                    if len(line) > self.MAX_RECIPIENT:
                        self._part = "text"
                        continue
                    return events
                self._recipient = line.strip()
                if self._recipient == self._all:
                    self._part, self._buf = "text", rest
                elif self._recipient in self._names:
                    self._part, self._buf = "call", rest
                else:
                    self._part = "text"  # (the line is kept: it is text)
                continue
            i = self._buf.find(self._mark)
            if self._part == "call":
                if i < 0:
                    return events
                events += self._end_call(self._buf[:i])
                self._buf, self._part = self._buf[i:], "recipient"
                continue
            if i >= 0:
                piece, self._buf, self._part = self._buf[:i], self._buf[i:], "recipient"
            else:
                cut = len(self._buf) - partial_suffix(self._buf, self._mark)
                piece, self._buf = self._buf[:cut], self._buf[cut:]
            if piece:
                events.append(("text", piece))
            if i < 0:
                return events

    def _end_call(self, body: str) -> list[tuple[str, object]]:
        args = json_value(body.strip())
        if not isinstance(args, dict):
            return [("text", f"{self._recipient}\n{body}")]
        call = ToolCall(new_call_id(self._prefix), self._recipient, json.dumps(args))
        self.calls.append(call)
        return [("call_start", call), ("call_args", call.arguments), ("call_end", call)]

    def finish(self) -> list[tuple[str, object]]:
        rest, self._buf = self._buf, ""
        if self._part == "call":
            return self._end_call(rest)
        return [("text", rest)] if rest else []
