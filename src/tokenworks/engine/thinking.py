"""A completion's thinking, followed token by token: where it opens and closes, how many
tokens it took, and the end marker forced once its budget is spent.

A reasoning model writes its thinking between markers (Qwen3's <think> ... </think>); a
template may open them in the prompt, or the model opens them with its first tokens. With
a budget of N, once N tokens have been thought without the end marker, the end marker's
tokens are the next ones whatever the model prefers, and the answer follows (the same
"budget forcing" as s1's, the other way round). The markers are matched as token ids.
"""

from __future__ import annotations

from tokenworks.engine.request import Thinking

BEFORE, THINKING, ANSWER = "before", "thinking", "answer"


class ThinkingState:
    def __init__(self, spec: Thinking):
        self.spec = spec
        self.phase = THINKING if spec.opened else BEFORE
        self.inside = 0  # tokens since thinking opened, the end marker's so far included
        self.answer_at: int | None = None  # output tokens before the answer (markers included)
        self._forced: list[int] = []
        self._check_budget()

    @property
    def forced(self) -> int | None:
        """The token the next step must give (the end marker's), if any."""
        return self._forced[0] if self._forced else None

    @property
    def free_tokens(self) -> int | None:
        """Tokens that may still be generated before one is forced (None: no bound)."""
        if self._forced:
            return 0
        if self.phase == ANSWER or self.spec.budget is None:
            return None
        return max(self.spec.budget - self.inside, 0)

    def reasoning_tokens(self, generated: int) -> int:
        """Of `generated` output tokens, those that are thinking (its markers included)."""
        if self.answer_at is not None:
            return self.answer_at
        return generated if self.phase == THINKING else 0

    def observe(self, output_ids: list[int]) -> None:
        """The output grew by one token (its last)."""
        if self._forced and output_ids[-1] == self._forced[0]:
            self._forced.pop(0)
        if self.phase == BEFORE:
            start, n = self.spec.start_ids, len(output_ids)
            if not start or output_ids[: len(start)] != list(start)[:n]:
                self.phase, self.answer_at = ANSWER, 0
            elif n == len(start):
                self.phase = THINKING
                self._check_budget()
            return
        if self.phase != THINKING:
            return
        self.inside += 1
        end = list(self.spec.end_ids)
        if output_ids[-len(end) :] == end:
            self.phase, self.answer_at, self._forced = ANSWER, len(output_ids), []
            return
        self._check_budget()

    def _check_budget(self) -> None:
        budget = self.spec.budget
        if self.phase == THINKING and not self._forced and budget is not None:
            if self.inside >= budget:
                self._forced = list(self.spec.end_ids)
