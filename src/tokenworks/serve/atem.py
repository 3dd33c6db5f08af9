"""Muse Glimmer's ATEM format (serve/tool_formats.py lists them all): an answer is a run of
messages, each addressed by its header,

    <|start|>assistant to=self<|message|>thinking...<|eom|>
    <|start|>assistant to=user<|message|>text for the user<|eom|>
    <|start|>assistant to=get_weather<|message|><atem:function_calls>
    <atem:invoke name="get_weather"><atem:parameter name="city">Paris</atem:parameter>
    </atem:invoke></atem:function_calls><|eot|>

self's message is the thinking, user's the answer, a tool's its call, the parameters typed
by the tool's schema. The prompt ends with the first "<|start|>assistant", so the output
starts at " to=". Call markup inside the user's or self's message is text.
"""

from __future__ import annotations

import json
import re

from tokenworks.serve.harmony import MESSAGE, RECIPIENT, START, HarmonyParser
from tokenworks.serve.tool_format_base import marker_terminal
from tokenworks.serve.tools import Tool
from tokenworks.serve.xml_formats import MiniMaxM2

EOM, EOT = "<|eom|>", "<|eot|>"


class Atem(MiniMaxM2):
    name, start, end = "atem", "<atem:function_calls>", "</atem:function_calls>"
    channels = True  # its parser reads the whole answer: thinking, text and calls
    _TAG = re.compile(r"<(/?)(atem:invoke|atem:parameter)((?:\s+\w+=\"[^\"]*\")*)\s*>")
    _call_tag, _param_tag = "atem:invoke", "atem:parameter"

    def __init__(self, tokenizer=None):
        super().__init__(tokenizer)
        self.special_marker = True  # its headers' markers are control tokens the parser sees
        self._message, self._eom = (marker_terminal(tokenizer, m)[1] for m in (MESSAGE, EOM))

    def parser(self, tools: list[Tool], id_prefix: str, reasoning: bool = True):
        return AtemParser(self, tools, id_prefix, reasoning)

    def how_to_call(self) -> str:
        return (f"To call a function, write a message to it: {START}assistant to=NAME"
                f'{MESSAGE}{self.start}\n<atem:invoke name="NAME">\n<atem:parameter '
                f'name="KEY">VALUE</atem:parameter>\n</atem:invoke>\n{self.end}{EOM}')  # fmt: skip

    def render_call(self, name, arguments):
        params = "".join(f'<atem:parameter name="{k}">{self._value(v)}</atem:parameter>\n'
                         for k, v in arguments.items())  # fmt: skip
        return (f'{START}assistant to={name}{MESSAGE}{self.start}\n<atem:invoke name="{name}">'
                f"\n{params}</atem:invoke>\n{self.end}{EOM}")  # fmt: skip

    def _pair(self, key: str, value: str) -> str:
        return f'"<atem:parameter name=\\"{key}\\">" {value} "</atem:parameter>\\n"'

    def _invoke(self, name: str, body: str) -> str:
        return (f'" to={name}" {self._message} "{self.start}\\n<atem:invoke name=\\"{name}\\">'
                f'\\n" {body} "</atem:invoke>\\n{self.end}" {self._eom}')  # fmt: skip

    def _around(self, options: str) -> str:  # (each call is a whole message: _invoke)
        return f"({options})"


class AtemParser(HarmonyParser):
    """HarmonyParser's reading, with ATEM's headers: the recipient is the message's kind."""

    ENDS = (EOM, EOT)

    def __init__(self, fmt: Atem, tools: list[Tool], id_prefix: str, reasoning: bool):
        super().__init__(id_prefix, reasoning)
        self._fmt, self._tools = fmt, tools

    def _open(self, header: str) -> None:
        header = header.replace(START, "").strip()
        found = RECIPIENT.search(header)
        to = found.group(1) if found else "user"
        self._header, self._in_body, self._args, self._name = header, True, "", to
        if to == "self":
            self._kind = "reasoning" if self._reasoning else "raw"
        else:
            self._kind = "text" if to == "user" else "call"

    def _arguments(self, body: str) -> str | None:
        calls = self._fmt.parse(body, self._tools) if self._fmt.start in body else None
        return json.dumps(calls[0][1]) if calls else None
