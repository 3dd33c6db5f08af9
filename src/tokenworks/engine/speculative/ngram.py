"""Prompt lookup: guess that the text goes on the way it went after the last time its
final few tokens appeared (no second model; Saxena 2023, vLLM's and llama.cpp's n-gram).

For n from prompt_lookup_max down to prompt_lookup_min, find the most recent earlier place
where the sequence's last n tokens (prompt and output together) occurred, and propose the
up to k tokens that followed them there. Copy-heavy work (editing, summarising, code
that repeats its identifiers) finds long matches; free text mostly finds none, and then
nothing is proposed and the step is a plain decode.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def lookup(ids: np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:
    """The continuation (at most k tokens) of the latest earlier match of ids' suffix."""
    length = len(ids)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = ids[length - n :]
        # windows that start before the suffix itself does and are followed by a token
        windows = sliding_window_view(ids[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return ids[start : start + k].tolist()
    return []


class NgramProposer:
    """Proposes from each sequence's own tokens; point masses (no distribution)."""

    name = "ngram"

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max

    def propose(self, wants: list[tuple[object, int]]) -> dict:
        """{seq: (tokens, None)} for the sequences that found a match; wants: (seq, k)."""
        out = {}
        for seq, k in wants:
            tokens = lookup(np.asarray(seq.all_ids, dtype=np.int64), self.n_min, self.n_max, k)
            if tokens:
                out[seq] = (tokens, None)
        return out

    def end_step(self, live) -> None:
        """Nothing is kept between steps."""

    def describe(self) -> str:
        return f"n-gram prompt lookup (n {self.n_min}..{self.n_max})"
