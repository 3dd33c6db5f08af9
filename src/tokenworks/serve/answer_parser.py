"""A completion's generated text split for the protocols: its thinking, its answer's text
and its tool calls, as events in the order they stream. Both protocols' assemblers read
these events, streamed or not, so the two cannot disagree."""

from __future__ import annotations

from dataclasses import dataclass

from tokenworks.engine.request import Thinking
from tokenworks.serve import reasoning
from tokenworks.serve.reasoning import Reasoning, ReasoningSplitter
from tokenworks.serve.tools import ToolCallParser, partial_suffix


def request_thinking(state, prompt: str, asked: list[tuple[str, object]]) -> Thinking | None:
    """What the engine follows of a request's thinking (None where the model does not
    think): the markers, whether the prompt opened them, and its budget, the first of the
    request's (field, value) pairs that is set, else the server's."""
    if state.reasoning is None:
        return None
    budget = reasoning.request_budget(state.reasoning, asked, state.max_model_len)
    return reasoning.thinking(state.reasoning, state.tokenizer, prompt, budget)


def answer_parser(state, thinking: Thinking | None, tools: list, id_prefix: str = "call_"):
    """The parser of one completion of a request that offers `tools`."""
    opened = thinking.opened if thinking is not None else None
    return make_answer_parser(state.reasoning, opened, state.tool_format, tools, id_prefix)


def make_answer_parser(reasoning: Reasoning | None, opened: bool | None, fmt, tools: list,
                       id_prefix: str = "call_") -> AnswerParser:  # fmt: skip
    """opened: whether the output starts as thinking (None: this request does not think).
    A format that writes its thinking in channels (harmony) reads the whole answer itself."""
    if fmt.channels:
        return AnswerParser(calls=fmt.parser(tools, id_prefix, reasoning=reasoning is not None))
    wrap = fmt.answer_markers + (fmt.stray_thinking if opened is not None else ())
    if not tools:
        return AnswerParser(reasoning, opened, answer_markers=wrap)
    return AnswerParser(reasoning, opened, fmt.parser(tools, id_prefix), fmt.starts, wrap)


def skip_special(state, tools: list, skip_special_tokens: bool) -> bool:
    """skip_special_tokens for a request: False where the parser must see a special token:
    the start of a call where tools are offered (Mistral's [TOOL_CALLS]), or a channel's
    markers (harmony)."""
    fmt = state.tool_format
    return skip_special_tokens and not ((tools or fmt.channels) and fmt.special_marker)


class AnswerParser:
    """feed(text, finished) -> events: ("reasoning", str) for thinking, ("text", str), and
    the ToolCallParser's call events where tools were offered."""

    def __init__(
        self,
        reasoning: Reasoning | None = None,
        opened: bool | None = None,
        calls: ToolCallParser | None = None,
        call_starts: tuple[str, ...] = (),
        answer_markers: tuple[str, ...] = (),
    ):
        """opened: whether the output starts as thinking (None: this request does not think);
        call_starts: where a tool call may begin, which ends thinking never closed;
        answer_markers: markers the format wraps its answer's text in, taken out of it."""
        self._splitter = (
            ReasoningSplitter(reasoning, opened, call_starts)
            if reasoning is not None and opened is not None
            else None
        )
        self._calls = calls
        self._unwrap = Unwrap(answer_markers) if answer_markers else None

    def feed(self, text: str, finished: bool) -> list[tuple[str, object]]:
        if self._splitter is not None:
            pieces = self._splitter.feed(text, finished)
        else:
            pieces = [("text", text)] if text else []
        if self._unwrap is not None:
            pieces = self._unwrap.pieces(pieces, finished)
        events: list[tuple[str, object]] = []
        for kind, piece in pieces:
            if kind == "text" and self._calls is not None:
                events += self._calls.feed(piece)
            else:
                events.append((kind, piece))
        if finished and self._calls is not None:
            events += self._calls.finish()
        return events


class Unwrap:
    """Text pieces with markers taken out as they stream (Command R7B's <|START_RESPONSE|>
    and <|END_RESPONSE|> around its answer): what may be a marker's start is held back until
    the next piece shows it is not."""

    def __init__(self, markers: tuple[str, ...]):
        self.markers = sorted(markers, key=len, reverse=True)  # the longest matched first
        self._held = ""

    def _out(self, text: str) -> str:
        for marker in self.markers:
            text = text.replace(marker, "")
        return text

    def pieces(self, pieces: list[tuple[str, str]], finished: bool) -> list[tuple[str, str]]:
        out = []
        for kind, piece in pieces:
            if kind != "text":
                out.append((kind, piece))
                continue
            text = self._held + piece
            keep = max(partial_suffix(text, m) for m in self.markers)
            text, self._held = self._out(text[: len(text) - keep]), text[len(text) - keep :]
            if text:
                out.append(("text", text))
        if finished and self._held:
            if text := self._out(self._held):
                out.append(("text", text))
            self._held = ""
        return out


@dataclass
class AnswerStep:
    """What one step added to an answer: its events (serve/answer_parser.py's), the output
    tokens they took, and how it ended where it did."""

    prompt_tokens: int
    cached_tokens: int
    events: list
    tokens: int
    finish: str | None = None
    stop_reason: str | int | None = None
    known_usage: bool = False  # the counts arrive with the finish (an upstream's usage)
