"""LLMEngine: the heartbeat. step() = schedule -> run the model -> sample -> postprocess.

Everything that generates (the offline LLM API, the CLI, benchmarks, later the server) is
built on step(). The scheduling here is the simplest continuous batching: new requests are
admitted into free cache rows and prefilled together; otherwise every running sequence
decodes one token in one flat batch. Finished sequences free their row at once, so a
waiting request joins the batch on the next step.
"""

from __future__ import annotations

import itertools
from collections import deque

import torch

from tokenworks.config import EngineConfig
from tokenworks.engine.request import FinishReason, SamplingParams
from tokenworks.engine.runner import ModelRunner
from tokenworks.engine.sampler import sample_one
from tokenworks.engine.sequence import Sequence, SequenceStatus
from tokenworks.models import build_model, load
from tokenworks.models.loader import LoadedModel
from tokenworks.ops.attention import KVCache
from tokenworks.tokenizer import TokenizerWrapper

_CACHE_GRANULE = 256  # cache rows grow in steps of this many tokens


class PromptTooLongError(ValueError):
    pass


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        self.config = config
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        loaded = loaded or load(config.model)
        self.loaded = loaded
        self.spec = loaded.spec
        self.tokenizer = TokenizerWrapper.from_loaded(loaded)
        self.model = build_model(
            self.spec, loaded.weights, config.torch_dtype, config.device, config.quantization
        )
        self.max_model_len = min(
            config.max_model_len or self.spec.max_position, self.spec.max_position
        )
        self.cache = KVCache(
            self.spec.n_layers,
            config.max_num_seqs,
            self.spec.n_kv_heads,
            _CACHE_GRANULE,
            self.spec.head_dim,
            config.torch_dtype,
            config.device,
        )
        self.runner = ModelRunner(self.model, self.cache, config.device)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.free_rows = list(range(config.max_num_seqs))
        self._ids = itertools.count()

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        request_id: str | None = None,
    ) -> Sequence:
        params = params or SamplingParams()
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("give a prompt or prompt_token_ids")
            prompt_token_ids = self.tokenizer.encode(prompt)
        if not prompt_token_ids:
            raise ValueError("the prompt is empty: give at least one token")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.spec.vocab_size]
        if bad:
            raise ValueError(
                f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.spec.vocab_size})"
            )
        if len(prompt_token_ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(prompt_token_ids)} tokens, but the context holds "
                f"{self.max_model_len} (prompt plus at least one new token); shorten the prompt"
            )
        seq = Sequence(
            request_id or f"req-{next(self._ids)}",
            prompt,
            prompt_token_ids,
            params,
            self.tokenizer,
            self.tokenizer.eos_token_ids,
            self.max_model_len,
        )
        self.waiting.append(seq)
        return seq

    def abort_request(self, request_id: str) -> None:
        for seq in [*self.waiting, *self.running]:
            if seq.request_id == request_id and not seq.finished:
                seq.finish(FinishReason.ABORT)
        self.waiting = deque(s for s in self.waiting if not s.finished)
        self._release_finished()

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ the loop

    def _admit(self) -> list[Sequence]:
        admitted = []
        while self.waiting and self.free_rows:
            seq = self.waiting.popleft()
            seq.cache_row = self.free_rows.pop(0)
            seq.status = SequenceStatus.RUNNING
            need = min(seq.num_tokens + seq.params.max_tokens, self.max_model_len)
            if need > self.cache.max_len:
                granules = -(-need // _CACHE_GRANULE)
                self.cache.grow(min(granules * _CACHE_GRANULE, self.max_model_len))
            admitted.append(seq)
        self.running.extend(admitted)
        return admitted

    def _release_finished(self) -> None:
        for seq in self.running:
            if seq.finished and seq.cache_row is not None:
                self.free_rows.append(seq.cache_row)
                seq.cache_row = None
        self.running = [s for s in self.running if not s.finished]

    def step(self) -> list[Sequence]:
        """Run one forward pass; return the sequences that got a new token."""
        batch = self._admit() or list(self.running)
        if not batch:
            return []
        logits = self.runner.run(batch).cpu()
        no_history = torch.empty(0, dtype=torch.long)
        for seq, row in zip(batch, logits, strict=True):
            if seq.params.uses_penalties:  # only penalties read the token history
                prompt, output = seq.prompt_tensor(), seq.output_tensor()
            else:
                prompt = output = no_history
            result = sample_one(row, seq.params, prompt, output, seq.generator)
            seq.append(result)
        self._release_finished()
        return batch
