"""Sequence bookkeeping that the runner relies on each step."""

from __future__ import annotations

from tokenworks.engine.request import SamplingParams
from tokenworks.engine.sequence import Sequence


def test_ids_between_equals_a_slice_of_all_ids():
    seq = Sequence("r", None, [5, 6, 7, 8], SamplingParams(max_tokens=8), None, (), 64)
    seq.output_ids += [9, 10, 11]
    every = seq.all_ids
    for start in range(len(every) + 1):
        for end in range(start, len(every) + 2):
            assert seq.ids_between(start, end) == every[start:end], (start, end)
