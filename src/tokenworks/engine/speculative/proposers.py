"""Builds the proposer a SpeculativeConfig names, checking it against the target at
startup: a draft model must share the target's tokenizer and be no larger than it."""

from __future__ import annotations

import torch

from tokenworks.config import EngineConfig
from tokenworks.engine.kv_pool import KVPool
from tokenworks.engine.runner import open_kernels
from tokenworks.engine.speculative.draft import DraftModelProposer
from tokenworks.engine.speculative.ngram import NgramProposer
from tokenworks.engine.speculative.speculator import Speculator
from tokenworks.models import build_model, load
from tokenworks.models.loaded import LoadedModel
from tokenworks.tokenizer import TokenizerWrapper


class DraftModelError(ValueError):
    """The draft model cannot draft for this target."""


def parameter_count(loaded: LoadedModel) -> int:
    return sum(t.numel() for t in loaded.weights.values())


def check_draft(draft: LoadedModel, target: LoadedModel, target_params: int) -> None:
    """A clear error unless draft can propose tokens the target reads the same way."""
    name = draft.model_id
    if draft.spec.vocab_size != target.spec.vocab_size:
        raise DraftModelError(
            f"draft model {name} has a vocabulary of {draft.spec.vocab_size} tokens, the target "
            f"{target.model_id} {target.spec.vocab_size}: a drafter needs the target's tokenizer"
        )
    ours = TokenizerWrapper.from_loaded(draft).tk.get_vocab(with_added_tokens=True)
    theirs = TokenizerWrapper.from_loaded(target).tk.get_vocab(with_added_tokens=True)
    if ours != theirs:
        differ = sorted(set(ours.items()) ^ set(theirs.items()))[:3]
        raise DraftModelError(
            f"draft model {name} does not share the target {target.model_id}'s tokenizer "
            f"(entries that differ, e.g. {differ}); pick a drafter from the target's family"
        )
    if draft.spec.eos_token_ids != target.spec.eos_token_ids:
        raise DraftModelError(
            f"draft model {name} ends text with {draft.spec.eos_token_ids}, the target with "
            f"{target.spec.eos_token_ids}: they are not the same tokenizer"
        )
    ours_n = parameter_count(draft)
    if ours_n > target_params:
        raise DraftModelError(
            f"draft model {name} has {ours_n / 1e6:.0f}M parameters, more than the target "
            f"{target.model_id}'s {target_params / 1e6:.0f}M: a drafter must be the cheaper "
            "model"
        )


def open_speculator(
    config: EngineConfig,
    target: LoadedModel,  # weights still loaded
    num_blocks: int,
    draft: LoadedModel | None = None,  # a drafter already read (else config names it)
    built: dict | None = None,  # drafters built before, to share: (model, dtype, quant) -> it
) -> Speculator | None:
    spec = config.speculative_config
    if spec is None:
        return None
    if spec.method == "ngram":
        return Speculator(spec, NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max))
    key = (spec.model, spec.dtype, spec.quantization)
    if built is not None and key in built:  # one drafter, one speculator at a time
        proposer, cost = built[key]
        return Speculator(spec, proposer, cost)
    if draft is None:
        draft = target if spec.model == target.model_id else load(spec.model)
    target_params = parameter_count(target)
    check_draft(draft, target, target_params)
    dtype = getattr(torch, spec.dtype) if spec.dtype else config.torch_dtype
    model = build_model(draft.spec, draft.weights, dtype, config.device, spec.quantization)
    s, bs = draft.spec, config.block_size
    pool = KVPool.for_spec(s, num_blocks, bs, dtype, config.device)
    kernels, _ = open_kernels(model, pool, config)
    label = f"draft model {draft.model_id}"
    if spec.quantization:
        label += f", {spec.quantization}"
    proposer = DraftModelProposer(
        model, pool, bs, config.device, kernels, config.max_num_batched_tokens, label
    )
    cost = parameter_count(draft) / target_params
    if built is not None:
        built[key] = (proposer, cost)
    return Speculator(spec, proposer, cost)
