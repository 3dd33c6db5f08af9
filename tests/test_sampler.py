"""Sampling filters against their definitions, and seeds."""

from __future__ import annotations

import pytest
import torch

from tokenworks import SamplingParams
from tokenworks.engine.request import SamplingError
from tokenworks.engine.sampler import (
    apply_penalties,
    filter_min_p,
    filter_top_k,
    filter_top_p,
    sample_one,
)

EMPTY = torch.tensor([], dtype=torch.long)


def logits(seed=0, v=50):
    return torch.randn(v, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("seed", range(5))
def test_top_k_1_and_top_p_near_0_sample_the_argmax(seed):
    x = logits(seed)
    for params in (
        SamplingParams(temperature=1.5, top_k=1),
        SamplingParams(temperature=1.5, top_p=1e-6),
    ):
        for s in range(10):
            g = torch.Generator().manual_seed(s)
            assert sample_one(x, params, EMPTY, EMPTY, g).token_id == int(x.argmax())


def test_top_k_keeps_exactly_the_k_largest():
    x = logits(1)
    kept = torch.isfinite(filter_top_k(x, 7))
    assert kept.sum() == 7 and set(kept.nonzero().flatten().tolist()) == set(
        x.topk(7).indices.tolist()
    )


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    x = logits(2)
    p = 0.6
    kept = torch.isfinite(filter_top_p(x, p))
    probs = x.softmax(-1)
    order = probs.argsort(descending=True)
    n = int(kept.sum())
    assert set(order[:n].tolist()) == set(kept.nonzero().flatten().tolist())
    assert probs[order[:n]].sum() >= p > probs[order[: n - 1]].sum()


def test_min_p_drops_what_it_must():
    x = torch.log(torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04]))
    kept = torch.isfinite(filter_min_p(x, 0.25))  # threshold 0.25 * 0.5 = 0.125
    assert kept.tolist() == [True, True, False, False, False]


def test_penalties_follow_their_definitions():
    x = torch.tensor([2.0, -2.0, 1.0, 0.5])
    rep = apply_penalties(x, SamplingParams(repetition_penalty=2.0), torch.tensor([0, 1]), EMPTY)
    assert rep.tolist() == [1.0, -4.0, 1.0, 0.5]
    out = torch.tensor([2, 2, 3])
    fp = apply_penalties(
        x, SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), EMPTY, out
    )
    assert fp.tolist() == [2.0, -2.0, 1.0 - 1.0 - 0.25, 0.5 - 0.5 - 0.25]


def test_same_seed_same_tokens_different_seed_different_tokens():
    x = logits(3, v=1000) / 3
    params = SamplingParams(temperature=1.0)

    def draw(seed):
        g = torch.Generator().manual_seed(seed)
        return [sample_one(x, params, EMPTY, EMPTY, g).token_id for _ in range(20)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_logprobs_are_the_raw_distribution():
    x = logits(4)
    r = sample_one(x, SamplingParams(temperature=0, logprobs=3), EMPTY, EMPTY, None)
    lp = x.log_softmax(-1)
    assert r.logprob == pytest.approx(float(lp.max()))
    assert [i for i, _ in r.top] == lp.topk(3).indices.tolist()


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": 2}, "min_p"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"frequency_penalty": 3}, "frequency_penalty"),
        ({"logprobs": 99}, "logprobs"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_bad_sampling_values_name_what_to_fix(kwargs, needle):
    with pytest.raises(SamplingError, match=needle):
        SamplingParams(**kwargs)
