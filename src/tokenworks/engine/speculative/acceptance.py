"""The acceptance rules that keep speculative output exactly the target's.

The target has scored k proposed tokens in one pass: row j of its logits is its
distribution for the token after the first j proposals. Greedy keeps the longest prefix of
proposals that equal the target's argmax, then the target's own next token. Sampling uses
the modified rejection sampling of Leviathan et al. (2023) and Chen et al. (2023): accept
proposal d with probability min(1, p(d) / q(d)), where p is the target's and q the
drafter's distribution (after temperature, top-k, top-p and min-p); at the first rejection
draw from norm(max(0, p - q)) instead, and when all k pass draw a bonus token from the
last row. Each emitted token is then distributed exactly as the target alone would have
drawn it. A proposer with no distribution (n-gram lookup) is a point mass: q(d) = 1.
"""

from __future__ import annotations

import torch

from tokenworks.engine.request import SamplingParams
from tokenworks.engine.sampler import (
    SampleResult,
    apply_penalties,
    distribution,
    with_logprobs,
)


def accept_probability(p_token: float, q_token: float) -> float:
    """min(1, p/q): the chance a proposal the drafter chose with probability q survives."""
    return 1.0 if p_token >= q_token else p_token / q_token


def residual(p: torch.Tensor, q: torch.Tensor | None, token: int) -> torch.Tensor:
    """norm(max(0, p - q)): what to draw from once `token` was rejected (q None: the
    proposal was a point mass on token, so the residual is p without it)."""
    if q is None:
        r = p.clone()
        r[token] = 0
    else:
        r = (p - q).clamp_(min=0)
    total = r.sum()
    return p if total <= 0 else r / total


def greedy_prefix(draft: list[int], argmax: list[int]) -> list[SampleResult]:
    """Plain greedy: the proposals equal to the target's argmax, then its next token."""
    out = []
    for d, t in zip(draft, argmax, strict=False):
        if d != t:
            break
        out.append(SampleResult(d, None, None))
    out.append(SampleResult(argmax[len(out)], None, None))
    return out


def verify(
    logits: torch.Tensor,  # [k + 1, V] float32: the target's rows, grammar masks applied
    argmax: list[int],  # each row's argmax (plain greedy reads only these)
    draft: list[int],  # the k proposals
    q: torch.Tensor | None,  # [k, V] the drafter's distributions, or None (point masses)
    params: SamplingParams,
    prompt_ids: torch.Tensor,
    output_ids: torch.Tensor,
    generator: torch.Generator | None,
) -> list[SampleResult]:
    """The tokens to emit: the accepted proposals and one token of the target's own."""
    if params.fast_greedy:
        return greedy_prefix(draft, argmax)
    out: list[SampleResult] = []
    for j in range(len(draft) + 1):
        row = logits[j]
        history = output_ids
        if params.uses_penalties and j:  # row j sees the proposals before it as output
            history = torch.cat([output_ids, torch.tensor(draft[:j], dtype=torch.long)])
        x = apply_penalties(row, params, prompt_ids, history)
        if params.greedy:
            token = int(torch.argmax(x))
            out.append(with_logprobs(token, row, params))
            if j == len(draft) or token != draft[j]:
                return out
            continue
        p = distribution(x, params)
        if j == len(draft):  # every proposal passed: the bonus token
            out.append(with_logprobs(_draw(p, generator), row, params))
            return out
        d = draft[j]
        q_d = 1.0 if q is None else float(q[j, d])
        u = float(torch.rand((), generator=generator))
        if u < accept_probability(float(p[d]), q_d):
            out.append(with_logprobs(d, row, params))
            continue
        token = _draw(residual(p, None if q is None else q[j], d), generator)
        out.append(with_logprobs(token, row, params))
        return out
    return out


def _draw(p: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(p, 1, generator=generator))
