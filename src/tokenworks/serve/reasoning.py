"""Reasoning: a model's thinking, between its think markers, kept apart from its answer.

Which markers a model writes is the server's `--reasoning-parser`: auto (the markers the
chat template writes: THINK_MARKERS, or gpt-oss's analysis channel where it writes
harmony's), none, qwen3, or deepseek_r1 (whose answer is thinking until </think>, opened
or not). The text between them comes back as
`reasoning_content` in OpenAI chat and as `thinking` blocks in Anthropic Messages; the
engine counts its tokens and, with a budget, forces the end marker once the budget is
spent (engine/thinking.py). A request's budget is `max_reasoning_tokens`,
`reasoning_effort` (EFFORT_BUDGETS) or Anthropic's `thinking.budget_tokens`, else
`--reasoning-budget`.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenworks.engine.request import Thinking
from tokenworks.serve.errors import bad_request
from tokenworks.serve.tools import partial_suffix

REASONING_PARSERS = ("auto", "none", "qwen3", "deepseek_r1")
# the think markers templates write (auto takes the first pair whose end the template
# names): Qwen3's and DeepSeek's, Mistral's, Command R7B's, Seed-OSS's, Gemma 4's, MiniMax
# M3's
THINK_MARKERS = (
    ("<think>", "</think>"), ("[THINK]", "[/THINK]"),
    ("<|START_THINKING|>", "<|END_THINKING|>"), ("<seed:think>", "</seed:think>"),
    ("<|channel>thought", "<channel|>"), ("<mm:think>", "</mm:think>"),
)  # fmt: skip
APRIEL = ("Here are my reasoning steps:\n", "[BEGIN FINAL RESPONSE]")  # words, not markers
# reasoning_effort -> thinking tokens at most (None: the model's own length)
EFFORT_BUDGETS = {"none": 0, "minimal": 0, "low": 512, "medium": 2048, "high": None}


@dataclass(frozen=True)
class Reasoning:
    """How this server's model thinks."""

    open: str
    close: str
    always: bool = False  # the answer starts as thinking even where nothing opened it
    keep_open: bool = False  # the opening is words of the thinking (Apriel's), kept in it
    budget: int | None = None  # the server's default (--reasoning-budget)


def resolve(parser: str, template_source: str | None, budget: int | None) -> Reasoning | None:
    """The model's reasoning markers under --reasoning-parser (None: it does not think);
    a harmony template's (gpt-oss) are its analysis channel's."""
    if parser == "none":
        return None
    source = template_source or ""
    if parser == "auto" and "<|channel|>" in source:
        return Reasoning("<|channel|>analysis<|message|>", "<|end|>", budget=budget)
    if parser == "auto" and "to=self<|message|>" in source:  # Muse Glimmer's message to self
        return Reasoning(" to=self<|message|>", "<|eom|>", budget=budget)
    if parser == "auto" and "'<|open|>' + tag" in source:  # Kimi K3's tags, built in Jinja
        return Reasoning("<|open|>think<|sep|>", "<|close|>think<|sep|>", budget=budget)
    if parser == "auto" and APRIEL[1] in source:
        return Reasoning(*APRIEL, keep_open=True, budget=budget)
    if parser == "auto":
        found = next(((o, c) for o, c in THINK_MARKERS if c in source), None)
        return Reasoning(*found, budget=budget) if found else None
    return Reasoning("<think>", "</think>", always=parser == "deepseek_r1", budget=budget)


def request_budget(reasoning: Reasoning, asked: list[tuple[str, object]], limit: int) -> int | None:
    """A request's thinking budget: the first of its (field, value) pairs that is set
    (reasoning_effort mapped by EFFORT_BUDGETS), else the server's. Bounded by limit
    (the context), with a 400 naming the field."""
    for name, value in asked:
        if value is None:
            continue
        if isinstance(value, str):
            return EFFORT_BUDGETS[value]
        if value > limit:
            raise bad_request(
                f"{name} is {value}; at most {limit} here (the model's context)", name
            )
        return value
    return reasoning.budget


def thinking(reasoning: Reasoning, tokenizer, prompt: str, budget: int | None) -> Thinking:
    """What the engine follows for one request: the markers as token ids, and whether the
    prompt (its template) already opened them."""
    return Thinking(
        end_ids=tuple(tokenizer.encode(reasoning.close, add_special_tokens=False)),
        start_ids=tuple(tokenizer.encode(reasoning.open, add_special_tokens=False)),
        opened=opened_by(reasoning, prompt),
        budget=budget,
    )


def opened_by(reasoning: Reasoning, prompt: str) -> bool:
    """Whether the model's output starts as thinking after this prompt."""
    return reasoning.always or prompt.rstrip().endswith(reasoning.open.rstrip())


class ReasoningSplitter:
    """A completion's text as ("reasoning", str) and ("text", str) pieces as it streams:
    the reasoning is exactly the text between the markers; the answer after the end
    marker starts at its first non-blank character. Text that may be the start of a
    marker is held back until it is clear."""

    def __init__(self, reasoning: Reasoning, opened: bool, call_starts: tuple[str, ...] = ()):
        """call_starts: where a tool call may begin, which ends thinking that is never
        closed (a model that goes from thinking straight to a call, as Qwen3.5's and Kimi
        K2's may); a call the end marker follows is part of the thinking."""
        self.r = reasoning
        self._calls = call_starts
        self._default = "thinking" if opened else "answer"
        self._phase = "before"
        self._buf = reasoning.open if opened and reasoning.keep_open else ""

    def feed(self, text: str, finished: bool = False) -> list[tuple[str, str]]:
        self._buf += text
        out: list[tuple[str, str]] = []
        if self._phase == "before":
            head = self._buf.lstrip()
            if head.startswith(self.r.open):
                kept = 0 if self.r.keep_open else len(self.r.open)
                self._phase, self._buf = "thinking", head[kept:]
            elif head.startswith(self.r.close):  # an empty thinking, its end alone (MiniMax M3)
                self._phase, self._buf = "opening", head[len(self.r.close) :]
            elif (self.r.open.startswith(head) or self.r.close.startswith(head)) and not finished:
                return out  # maybe a marker yet
            else:
                self._phase = self._default
        if self._phase == "thinking":
            j = self._buf.find(self.r.close)
            found = [i for i in map(self._buf.find, self._calls) if i >= 0] if j < 0 else []
            k = min(found, default=-1)
            if k >= 0 and finished:  # never closed: the call ended the thinking
                if k:
                    out.append(("reasoning", self._buf[:k]))
                self._phase, self._buf = "answer", self._buf[k:]
            elif j < 0:  # (from a call on, held: the end marker may still close it)
                ends = (self.r.close, *self._calls)
                keep = 0 if finished else max(partial_suffix(self._buf, m) for m in ends)
                cut = k if k >= 0 else len(self._buf) - keep
                piece, self._buf = self._buf[:cut], self._buf[cut:]
                return out + ([("reasoning", piece)] if piece else [])
            else:
                if j:
                    out.append(("reasoning", self._buf[:j]))
                self._phase, self._buf = "opening", self._buf[j + len(self.r.close) :]
        if self._phase == "opening":  # the answer's leading blank lines are dropped
            self._buf = self._buf.lstrip()
            if not self._buf:
                return out
            self._phase = "answer"
        piece, self._buf = self._buf, ""
        return out + ([("text", piece)] if piece else [])
