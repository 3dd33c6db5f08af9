"""gpt-oss's harmony format: an answer is a run of messages, each a header and a body,

    <|channel|>analysis<|message|>thinking...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
    <|message|>{"city": "Paris"}<|call|>

The header names the channel (analysis: thinking; final, or commentary without a
recipient: the answer) and maybe a recipient (`to=functions.NAME`: a call of that tool,
its body the arguments; another recipient, such as the built-in `python` or
`container.exec`, is a tool tokenworks does not run, and its message is left out). The
recipient may stand before the channel or after it. One parser reads the channels whether
tools are offered or not, streaming each body as it comes (a call whole, at its end); with
reasoning off, an analysis message stays in the answer as the model wrote it. (The format
itself, how a call is described and forced, is serve/tool_formats.py's Harmony.)
"""

from __future__ import annotations

import json
import re

from tokenworks.serve.tools import ToolCall, new_call_id, partial_suffix

MESSAGE, CHANNEL, START, CONSTRAIN = "<|message|>", "<|channel|>", "<|start|>", "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")
_HEADER_START = re.compile("|".join(map(re.escape, (CHANNEL, START, " to="))))


class HarmonyParser:
    """The ToolCallParser interface over a harmony answer: feed(text) -> events
    ("reasoning", str), ("text", str) and the call events; finish() at the end."""

    ENDS = ENDS  # what ends a message

    def __init__(self, id_prefix: str = "call_", reasoning: bool = True):
        self._prefix, self._reasoning = id_prefix, reasoning
        self._buf, self._header, self._in_body = "", "", False
        self._kind, self._name, self._args = "text", "", ""
        self._plain_run = False  # text outside any message is streaming
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[tuple[str, object]]:
        self._buf += text
        events: list[tuple[str, object]] = []
        while True:
            if not self._in_body:
                events += self._plain()
                i = self._buf.find(MESSAGE)
                if i < 0:
                    return events
                self._open(self._buf[:i])
                self._buf = self._buf[i + len(MESSAGE) :]
                if self._kind == "raw":
                    events.append(("text", self._header + MESSAGE))
            end = min(((self._buf.find(e), e) for e in self.ENDS if e in self._buf), default=None)
            if end is None:
                keep = max(partial_suffix(self._buf, e) for e in self.ENDS)
                cut = len(self._buf) - keep
                piece, self._buf = self._buf[:cut], self._buf[cut:]
                events += self._body(piece)
                return events
            at, marker = end
            events += self._body(self._buf[:at])
            if self._kind == "raw":
                events.append(("text", marker))
            events += self._close()
            self._buf = self._buf[at + len(marker) :]

    def finish(self) -> list[tuple[str, object]]:
        if not self._in_body:  # a header never finished: as text
            rest, self._buf = self._buf, ""
            return [("text", rest)] if rest.strip() else []
        events = self._body(self._buf)
        self._buf = ""
        return events + self._close()

    def _plain(self) -> list[tuple[str, object]]:
        """Text before a header (a model that writes no channels): the answer's, streamed
        up to where a header may begin."""
        m = _HEADER_START.search(self._buf)
        cut = m.start() if m else len(self._buf) - max(
            partial_suffix(self._buf, h) for h in (CHANNEL, START, " to=")
        )  # fmt: skip
        text = self._buf[:cut]
        if not text.strip() and not (m and self._plain_run):
            if m:  # blanks between messages: dropped
                self._buf = self._buf[cut:]
            return []  # (or before what may be a header yet)
        self._buf, self._plain_run = self._buf[cut:], not m
        return [("text", text)] if text else []

    def _open(self, header: str) -> None:
        header = header.replace(START, "")
        channel = _CHANNEL.findall(header)
        recipient = RECIPIENT.search(header)
        to = recipient.group(1) if recipient else None
        channel = channel[-1] if channel else "final"
        self._header, self._in_body, self._args = header.strip(), True, ""
        if to is not None and to.startswith("functions."):
            self._kind, self._name = "call", to[len("functions.") :]
        elif to is not None and to != "assistant":
            self._kind = "other tool"
        elif channel == "analysis":
            self._kind = "reasoning" if self._reasoning else "raw"
        else:
            self._kind = "text"
        if self._kind == "raw":  # as the model wrote it, less the role
            self._header = CHANNEL + header.split(CHANNEL, 1)[-1] if CHANNEL in header else header

    def _arguments(self, body: str) -> str | None:
        """A call's arguments as JSON text, from its message's body."""
        try:
            return json.dumps(json.loads(body))
        except json.JSONDecodeError:
            return body.strip()

    def _body(self, piece: str) -> list[tuple[str, object]]:
        if not piece:
            return []
        if self._kind == "call":
            self._args += piece
            return []
        if self._kind == "other tool":
            return []
        return [("reasoning" if self._kind == "reasoning" else "text", piece)]

    def _close(self) -> list[tuple[str, object]]:
        self._in_body = False
        if self._kind != "call":
            return []
        arguments = self._arguments(self._args)
        if arguments is None:  # not a call's body after all: as the model wrote it
            return [("text", self._header + MESSAGE + self._args)]
        call = ToolCall(new_call_id(self._prefix), self._name, arguments)
        self.calls.append(call)
        return [("call_start", call), ("call_args", call.arguments), ("call_end", call)]
