"""Logits -> next tokens: penalties, temperature, top-k, top-p, min-p, seeded draws, logprobs.

The order matches vLLM: penalties on the raw logits, then temperature, then the truncation
filters (top-k, top-p, min-p), then one draw from what is left. Greedy (temperature 0) takes
the argmax after penalties. Logprobs are reported from the raw model distribution
(log_softmax of the unpenalised logits), as vLLM and the OpenAI API do.

Every token choice is made here: `prepare_rows` readies a batch's logits (grammar masks,
one argmax over the batch for plain greedy rows, in C where it builds), `sample_row`
picks one sequence's token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenworks.engine.request import SamplingParams
from tokenworks.kernels.products import argmax_rows


def apply_penalties(
    logits: torch.Tensor,  # [V] float32
    params: SamplingParams,
    prompt_ids: torch.Tensor,  # [P] int64
    output_ids: torch.Tensor,  # [O] int64
) -> torch.Tensor:
    """What a request does to the raw logits before they are sampled: its logit bias, then
    its penalties."""
    if params.logit_bias:
        logits = logits.clone()
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
        logits[ids] += torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype)
    if not params.uses_penalties:
        return logits
    if params.repetition_penalty != 1.0:
        seen = torch.cat([prompt_ids, output_ids]).unique()
        vals = logits[seen]
        logits = logits.clone()
        logits[seen] = torch.where(
            vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty
        )
    if (params.frequency_penalty or params.presence_penalty) and output_ids.numel():
        counts = torch.bincount(output_ids, minlength=logits.shape[0]).to(logits.dtype)
        logits = logits - params.frequency_penalty * counts
        logits = logits - params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def filter_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits ([V]); k <= 0 keeps all."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf"))


def filter_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability sums to at least p."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = sorted_logits.softmax(-1)
    before = probs.cumsum(-1) - probs  # mass of the tokens ranked above each one
    drop_sorted = before >= p  # the top token always survives (before = 0 < p)
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def filter_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top token's probability."""
    if min_p <= 0:
        return logits
    probs = logits.softmax(-1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))


@dataclass
class SampleResult:
    token_id: int
    logprob: float | None  # of the chosen token, in the raw distribution
    top: list[tuple[int, float]] | None  # top-n (id, logprob), best first


def sample_one(
    logits: torch.Tensor,  # [V] float32, raw from the model
    params: SamplingParams,
    prompt_ids: torch.Tensor,
    output_ids: torch.Tensor,
    generator: torch.Generator | None,
) -> SampleResult:
    x = apply_penalties(logits, params, prompt_ids, output_ids)
    if params.greedy:
        token = int(torch.argmax(x))
    else:
        token = int(torch.multinomial(distribution(x, params), 1, generator=generator))
    return with_logprobs(token, logits, params)


def distribution(x: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The probabilities a sampled token is drawn from ([..., V]): the logits after
    penalties (x), divided by the temperature, through top-k, top-p and min-p."""
    x = x / params.temperature
    x = filter_min_p(filter_top_p(filter_top_k(x, params.top_k), params.top_p), params.min_p)
    return x.softmax(-1)


def with_logprobs(token: int, logits: torch.Tensor, params: SamplingParams) -> SampleResult:
    """token's result, with its logprob and the top ones from the raw logits where asked."""
    if params.logprobs is None:
        return SampleResult(token, None, None)
    raw = logits.log_softmax(-1)
    top = []
    if params.logprobs > 0:
        vals, ids = torch.topk(raw, params.logprobs)
        top = list(zip(ids.tolist(), vals.tolist(), strict=True))
    return SampleResult(token, float(raw[token]), top)


def prompt_logprobs(
    logits: torch.Tensor, targets: list[int], top_n: int
) -> list[tuple[float, list[tuple[int, float]], int]]:
    """Each row's logprob of its target (the prompt token that follows the row's position)
    in the raw distribution, its top_n alternatives (best first) and its rank."""
    raw = logits.float().log_softmax(-1)
    chosen = raw[torch.arange(len(targets)), torch.tensor(targets)]
    ranks = (raw > chosen[:, None]).sum(-1).add(1).tolist()
    tops = [[] for _ in targets]
    if top_n > 0:
        vals, ids = torch.topk(raw, top_n)
        tops = [
            list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), vals.tolist(), strict=True)
        ]
    return list(zip(chosen.tolist(), tops, ranks, strict=True))


NO_HISTORY = torch.empty(0, dtype=torch.long)  # what sample_one gets without penalties


@dataclass
class ForwardOutput:
    """What a forward pass hands the sampler for its sampling rows."""

    logits: torch.Tensor | None  # [rows, V] in the model's dtype
    # [rows] int64, each row's argmax: set only when every row was plain greedy and the
    # forward path took the choices itself (the C LM head keeps each row's best, writing
    # no logits); the same choice as argmax_rows of the logits
    argmax: torch.Tensor | None = None
    # prompt logprobs (SamplingParams.prompt_logprobs): (sequence, the prompt position its
    # first row predicts, logits [rows, V] of consecutive positions)
    prompt: list[tuple] = field(default_factory=list)
    # embeddings (SamplingParams.pooling): (sequence, the position of its first row, final
    # hidden states [rows, hidden] of consecutive positions)
    pooled: list[tuple] = field(default_factory=list)


def argmax_only(seqs) -> bool:
    """Whether every row is plain greedy (no penalties, logprobs or grammar): then only
    each row's argmax is needed, and a forward path may hand back that alone."""
    return all(s.params.fast_greedy and s.matcher is None for s in seqs)


def prepare_rows(
    out: ForwardOutput, seqs, mask_rows, matchers=None
) -> tuple[torch.Tensor | None, list[int]]:
    """The batch's logits as the sampler reads them, and each row's plain argmax.
    seqs: each row's sequence; matchers: each row's grammar state where it is not its
    sequence's own (a row verifying a proposed token sees the grammar after the tokens
    proposed before it).

    Logits become float32 on the CPU where a row needs more than the argmax or a grammar
    masks it (mask_rows(logits, [(row, matcher)]) forbids what each grammar disallows);
    plain greedy rows take one argmax over the batch in the logits' own dtype (bfloat16
    to float32 is exact, so the choice is the same)."""
    if out.logits is None:
        return None, out.argmax.tolist()
    logits = out.logits
    if matchers is None:
        matchers = [s.matcher for s in seqs]
    guided = [(r, m) for r, m in enumerate(matchers) if m is not None]
    plain = all(s.params.fast_greedy for s in seqs)
    if guided or logits.device.type != "cpu" or not plain:
        logits = logits.float().cpu()
    if guided:
        mask_rows(logits, guided)
    return logits, argmax_rows(logits)


def sample_row(logits: torch.Tensor | None, r: int, seq, argmax: int) -> SampleResult:
    """seq's next token from row r (argmax: that row's, for plain greedy)."""
    p = seq.params
    forced = seq.forced_token  # a spent thinking budget's end marker
    if forced is not None:
        return (
            SampleResult(forced, None, None)
            if logits is None
            else with_logprobs(forced, logits[r], p)
        )
    if p.fast_greedy:
        return SampleResult(argmax, None, None)
    if p.uses_penalties:  # only penalties read the token history
        prompt, output = seq.prompt_tensor(), seq.output_tensor()
    else:
        prompt = output = NO_HISTORY
    return sample_one(logits[r], p, prompt, output, seq.generator)
