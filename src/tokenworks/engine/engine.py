"""LLMEngine: the heartbeat. step() = schedule -> run the model -> sample -> postprocess.

Everything that generates (the offline LLM API, the CLI, benchmarks, the server) is built
on step(). Each step the scheduler picks a flat batch that mixes prefill chunks and decode
tokens under a token budget (engine/scheduler.py); the runner writes their keys and values
into the paged block pool and computes logits for the sequences that reached their last
token; the sampler picks one token for each; finished sequences free their blocks at once,
so a waiting request can join on the very next step (continuous batching).

The file is the loop and what a step does to its sequences (sample, accept a verified
draft, fork n > 1, fail a request alone): one piece, since each of those reads and writes
the scheduler, the block manager and the request table together. How big the KV pool is
lives in engine/kv_budget.py, what the steps did in engine/step_log.py, which kernels run
in engine/runner.py.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import time
import weakref
from collections import deque
from collections.abc import Callable

import torch

from tokenworks.config import EngineConfig
from tokenworks.engine.admission import Admission, PromptTooLongError, RequestTooLargeError
from tokenworks.engine.host_memory import keep_freed_memory, release_freed_memory
from tokenworks.engine.kv_budget import GiB, kv_budget_bytes
from tokenworks.engine.kv_cache import BlockManager
from tokenworks.engine.kv_events import open_kv_events
from tokenworks.engine.kv_groups import KVLayout
from tokenworks.engine.kv_offload import HostTier
from tokenworks.engine.kv_pool import KVPool
from tokenworks.engine.kv_quant import bytes_per_token, check_available
from tokenworks.engine.lora import lora_reserve, open_loras, request_salt
from tokenworks.engine.rank import build_rank_model
from tokenworks.engine.request import FinishReason, SamplingParams
from tokenworks.engine.runner import ModelRunner, open_kernels
from tokenworks.engine.sampler import ForwardOutput, argmax_only
from tokenworks.engine.scheduler import Scheduler, SchedulerOutput
from tokenworks.engine.sequence import Sequence
from tokenworks.engine.speculative import open_speculator
from tokenworks.engine.step_log import StepCounts, StepLog, StepStats
from tokenworks.engine.step_sampling import sample_all
from tokenworks.engine.structured import GrammarCompiler
from tokenworks.engine.topology import (
    block_bytes_of,
    check_split,
    own_layers,
    rank_device,
    rank_threads,
    world_size,
)
from tokenworks.engine.warmup import warm_up
from tokenworks.engine.workers import WorkerRanks
from tokenworks.kernels.backend import KernelsUnavailableError
from tokenworks.models import load
from tokenworks.models.build import make_batch_invariant_
from tokenworks.models.compiled import CompileStats, compile_layers_
from tokenworks.models.loaded import LoadedModel
from tokenworks.tokenizer import TokenizerWrapper

log = logging.getLogger("tokenworks.engine")

__all__ = ["LLMEngine", "PromptTooLongError", "RequestTooLargeError", "StepStats"]


@dataclasses.dataclass
class _Flight:
    """A batch launched and not yet finished: what was scheduled, and the function that
    gives its forward output (engine/runner.py ModelRunner.start)."""

    out: SchedulerOutput
    result: Callable[[], ForwardOutput]


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel | None = None,
        draft: LoadedModel | None = None,  # speculative decoding's drafter, already read
    ):
        self.config = config
        self.core_thread = False  # a core loop (engine/core.py's CoreThread) steps it
        if rank_threads(config) is not None:
            torch.set_num_threads(rank_threads(config))
        if config.device == "cpu" and config.keep_freed_memory:
            keep_freed_memory()  # each step's buffers reuse the last step's pages
        own = loaded is None  # weights this engine read itself are dropped once built
        loaded = loaded or load(config.model, keep_index=config.keep_gguf_index)
        self.spec = loaded.spec
        self.tokenizer = TokenizerWrapper.from_loaded(loaded)
        if config.device == "cpu":  # building a large vocabulary's merges leaves free pages
            release_freed_memory()  # that would otherwise sit under the weights' peak
        # what the weights run as: the GGUF's blocks by default (config.resolved_quantization)
        self.quantization = config.resolved_quantization(loaded.gguf_index is not None)
        # the other ranks (tensor / pipeline parallel), joined before any model is built
        self.workers, topology = None, None
        if world_size(config) > 1:
            check_split(self.spec, config)
            self.workers, topology = WorkerRanks.start(config)
            weakref.finalize(self, self.workers.stop)
        # this process's model and its spec: the whole model, or rank 0's part of it
        self.model, self.rank_spec = build_rank_model(config, loaded, self.quantization, topology)
        self.compile_stats = None
        if config.compile:
            if self.quantization is not None:
                raise ValueError(
                    f"compile traces torch's products; this model's weights run as "
                    f"{self.quantization} blocks: add --quantization none"
                )
            self.compile_stats = CompileStats(layers=compile_layers_(self.model))
        if config.max_model_len and config.max_model_len > self.spec.max_position:
            raise ValueError(
                f"--max-model-len {config.max_model_len} is past the {self.spec.max_position} "
                f"tokens {self.spec.name} is made for (its positions, and any RoPE scaling "
                "its config gives, stop there): leave it unset or lower it"
            )
        self.max_model_len = config.max_model_len or self.spec.max_position
        bs = config.block_size
        # a rank's pool holds its own KV heads: the budget is each rank's
        if config.kv_cache_dtype != "auto":
            check_available(config.kv_cache_dtype)
            if self.spec.mla is not None:
                raise ValueError(
                    f"kv_cache_dtype {config.kv_cache_dtype}: latent attention caches one "
                    "latent row a token, kept in the model's dtype; use --kv-cache-dtype auto"
                )
        self.kv_bytes_per_token = bytes_per_token(
            self.rank_spec.shape, config.resolved_dtype, config.kv_cache_dtype
        )
        self.kv_layout = KVLayout.for_spec(self.rank_spec, config.sliding_window_kv == "free")
        self.block_bytes = block_bytes_of(
            self.rank_spec, config, self.kv_layout, self.kv_bytes_per_token
        )
        num_blocks = self.kv_budget_bytes() // self.block_bytes
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory {config.kv_cache_memory} GiB holds no {bs}-token block "
                f"({self.block_bytes} bytes each); give it more"
            )
        self.pool = KVPool.for_spec(
            self.rank_spec, num_blocks, bs, config.torch_dtype, rank_device(config, 0),
            self.kv_layout, own_layers(self.rank_spec, config, 0), config.kv_cache_dtype,
        )  # fmt: skip
        if self.workers is not None:  # each builds a pool of these blocks
            self.workers.ready(num_blocks)
        # the C kernels where they run for this model and these options (why not, if not),
        # and how this engine is batch-invariant: "kernels", "torch" or "" (it is not)
        self.c_kernels, self.kernels_off_because, self.invariance = self._open_kernels()
        # LoRA adapters, where enabled (loaded and unloaded through engine.lora), wrapped
        # around the modules after the C pass read the model's own products
        self.lora = open_loras(config, self.model, self.c_kernels,
                               lambda: {h.lora for h in self.requests.values()})  # fmt: skip
        self.blocks = BlockManager(num_blocks, bs, config.enable_prefix_caching, self.kv_layout)
        if config.kv_offload_gib:  # evicted cached blocks go to host memory, not away
            self.blocks.host = HostTier(self.pool, int(config.kv_offload_gib * GiB))
        self.admission = Admission(
            vocab_size=self.spec.vocab_size,
            context=self.max_model_len,
            context_source=self._context_source(),
            num_blocks=num_blocks,
            block_size=bs,
            layout=self.kv_layout,
            chunk=self._prompt_pass(),
        )
        self.scheduler = Scheduler(config, self.blocks, fixed_chunks=self.invariance == "torch")
        # speculative decoding, checked against the target now rather than at a request
        self.speculator = open_speculator(config, loaded, num_blocks, draft)
        # what records and tokenizers need of the model; the float32 weights it was built
        # from go (the model holds its own copy; a caller's `loaded` is the caller's)
        self.loaded = dataclasses.replace(loaded, weights={}) if own else loaded
        del loaded, draft
        if own and config.device == "cpu":
            release_freed_memory()
        # a pipeline's batches launched and not yet finished, oldest first; how many it
        # keeps going (one per stage by default; 1 where a drafter proposes from each
        # step's tokens, or the model is not split into stages)
        self._flights: deque[_Flight] = deque()
        self.in_flight = 1
        if config.pipeline_parallel_size > 1 and self.speculator is None:
            self.in_flight = config.pipeline_batches or config.pipeline_parallel_size
        self._launched_s = 0.0  # seconds of step() calls that launched and finished nothing
        self.runner = ModelRunner(
            self.model,
            self.pool,
            bs,
            config.device,
            batch_decode=self.invariance != "torch",
            kernels=self.c_kernels,
            compile_stats=self.compile_stats,
            workers=self.workers,
            # one batch at a time fills the stages with its micro-batches; batches in
            # flight fill them already, and a smaller part reads the weights as often
            micro_batches=config.pipeline_parallel_size if self.in_flight == 1 else 1,
        )
        self.runner.lora = self.lora
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self.requests: dict[str, Sequence] = {}  # unfinished requests by id (group heads)
        # requests that failed alone (sampling or a grammar raised for them) since the
        # last take_failures(): request id -> why; their sequences finish with "error"
        self.failures: dict[str, str] = {}
        self.step_log = StepLog(self.model)
        self.kv_events = None  # engine/kv_events.py's, opened once the warm-up is done
        log.info("%s", self.describe())
        if config.warmup and self.c_kernels is not None and self.c_kernels.invariant:
            # every batch runs as whole-step rows in C: nothing is built for a big step, and
            # the warm-up pass would cost a full step of decode rows (labs/cold_start.py)
            log.info("ready (no warm-up: the C kernels' whole step builds nothing for a big step)")
        elif config.warmup:
            t0 = time.perf_counter()
            log.info("warming up: one forward pass at the step budget, before any request")
            self.warm_up()
            log.info("ready (warm-up %.1f s)", time.perf_counter() - t0)
        self.kv_events = open_kv_events(config, self.blocks)  # (after the warm-up's blocks)

    def _prompt_pass(self) -> int | None:
        """The fewest tokens a prompt pass may take (what admission counts a windowed group
        holding): the scheduler shrinks a chunk to the blocks there are, down to one token;
        batch-invariant chunks are fixed; None: without chunked prefill, the whole prompt."""
        c = self.config
        if self.invariance == "torch":
            return c.max_num_batched_tokens
        return 1 if c.enable_chunked_prefill else None

    def _context_source(self) -> str:
        """Where max_model_len comes from, in the words a refusal uses."""
        if self.max_model_len < self.spec.max_position:
            return f"max_model_len {self.max_model_len} set for this engine"
        scaling = self.spec.rope_scaling
        if scaling is not None and scaling.extends_context:
            return f"the context {scaling.kind} RoPE scaling makes for {self.spec.name}"
        return f"the context {self.spec.name or 'the model'} was trained for"

    def _open_kernels(self) -> tuple:
        """(the C kernels or None, why not, the invariance mode). Batch invariance, unless
        switched off, comes from the kernels' whole step where they run the model; asked
        for where they cannot (an MoE model, latent attention, another device), torch's
        fixed tiles give it instead, and the C kernels stand aside."""
        # speculation asks for it: its verify rows must be computed as decode rows
        asked = True if self.config.speculative_config else self.config.batch_invariant
        kernels, why = open_kernels(self.model, self.pool, self.config)
        if asked is False or (kernels is not None and kernels.invariant):
            return kernels, why, "" if asked is False else "kernels"
        if asked is None:
            log.info("not batch-invariant: %s", why or "the C kernels' whole step cannot run it")
            return kernels, why, ""
        if self.config.kernels == "c":
            raise KernelsUnavailableError(
                "kernels='c' with batch_invariant: the C kernels cannot run this model "
                f"batch-invariant ({why or 'its experts run between C calls'}); drop one of the two"
            )
        make_batch_invariant_(self.model)
        return None, "batch_invariant runs torch's fixed tiles for this model", "torch"

    def kernels(self) -> str:
        """Which code computes this engine's batches, in words."""
        if self.c_kernels is None:
            return f"torch modules ({self.kernels_off_because})"
        return self.c_kernels.describe()

    def describe(self) -> str:
        """What the engine runs, as a user would want it said at start."""
        c, blocks = self.config, self.blocks
        gib = self.pool.nbytes / GiB
        host = blocks.host
        kept = "the model's dtype" if c.kv_cache_dtype == "auto" else c.kv_cache_dtype
        return (
            f"model {self.loaded.model_id} ({self.loaded.file_path}); dtype "
            f"{c.resolved_dtype}, quantization {self.quantization or 'none'}, kernels: "
            f"{self.kernels()}; KV {blocks.num_blocks} blocks of {blocks.block_size} tokens "
            f"({gib:.2f} GiB, {self.kv_layout.describe()}, {kept}, pages touched as used); "
            f"context "
            f"{self.max_model_len}; up to {c.max_num_seqs} sequences, "
            f"{c.max_num_batched_tokens} tokens a step; {torch.get_num_threads()} threads"
            + (f"; speculative: {self.speculator.describe()}" if self.speculator else "")
            + (f"; {self.in_flight} batches in flight" if self.in_flight > 1 else "")
            + (f"; host tier {host.capacity} blocks" if host is not None else "")
        )

    def warm_up(self) -> None:
        warm_up(self)

    @property
    def broken(self) -> str | None:
        """Why no step can run any more (a tensor-parallel rank failed), or None."""
        return self.workers.failed if self.workers is not None else None

    def close(self) -> None:
        """Stop the tensor-parallel workers and the KV events' sockets, where they run."""
        if self.workers is not None:
            self.workers.stop()
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None

    @property
    def stats(self) -> deque[StepStats]:
        """Recent steps' StepStats, oldest first."""
        return self.step_log.stats

    @property
    def totals(self) -> dict:
        """Running totals since start (the warm-up's left out): tokens, steps, preemptions."""
        return self.step_log.totals

    @property
    def routing_totals(self):
        """An MoE model's tokens per expert of each MoE layer since start (else None)."""
        return self.step_log.routing_totals

    @functools.cached_property
    def grammars(self) -> GrammarCompiler:
        """Compiles structured-output grammars for this tokenizer (built on first use)."""
        return GrammarCompiler(self.tokenizer, self.spec.vocab_size, self.tokenizer.eos_token_ids)

    def kv_bytes_held(self, seq: Sequence) -> int:
        """Bytes of KV blocks seq references now, in every layer group."""
        return sum(self.blocks.held(seq)) * self.block_bytes

    def kv_budget_bytes(self) -> int:
        """The KV pool's bytes (engine/kv_budget.py)."""
        held = lora_reserve(self.config, self.rank_spec.shape)  # the adapters' memory first
        return kv_budget_bytes(self.config, self.kv_layout, self.max_model_len, self.block_bytes,
                               held)  # fmt: skip

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora: str | None = None,
    ) -> Sequence:
        """Queue a request; return its first sequence (its `.group` holds all n).

        lora: the name of the LoRA adapter to run it with (None: the base model).

        Raises ValueError subclasses for bad input (PromptTooLongError, RequestTooLargeError,
        LoRANotFoundError) and QueueFullError when the waiting queue is full.
        """
        params = params or SamplingParams()
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("give a prompt or prompt_token_ids")
            prompt_token_ids = self.tokenizer.encode(prompt)
        refusal = self.admission.check(prompt_token_ids, params.max_tokens, params.n, clamp=True)
        if refusal is not None:
            raise refusal.error()
        vocab = self.admission.vocab_size
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(
                f"logit_bias names token {max(params.logit_bias)}: the vocabulary is [0, {vocab})"
            )
        request_id = request_id or self.new_request_id()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        cache_salt = request_salt(self.lora, lora, cache_salt)  # refuses one not loaded
        matcher = None
        if params.structured is not None:
            matcher = self.grammars.compile(params.structured)
        seq = Sequence(
            request_id,
            prompt,
            prompt_token_ids,
            params,
            self.tokenizer if self.config.detokenize else None,
            self.tokenizer.eos_token_ids,
            self.max_model_len,
            arrival=next(self._arrivals),
            priority=priority,
            cache_salt=cache_salt,
            matcher=matcher,
        )
        seq.lora = lora
        self.scheduler.add(seq)
        self.requests[request_id] = seq
        self.totals["prompt_tokens"] += len(prompt_token_ids)
        return seq

    def new_request_id(self) -> str:
        """An id no request of this engine has had."""
        return f"req-{next(self._ids)}"

    def abort_request(self, request_id: str) -> None:
        """Cancel a request: its sequences finish with reason abort and free their blocks."""
        head = self.requests.pop(request_id, None)
        if head is None:
            return
        for seq in head.group:
            if not seq.finished:
                seq.finish(FinishReason.ABORT)
            self.scheduler.remove(seq)

    def stop_sequence(self, request_id: str, index: int, stop: str, keep: int) -> bool:
        """End one completion at a stop string its caller found after its first `keep`
        tokens (with detokenize off, the caller holds the text); the tokens sampled past
        them are dropped. True where that finished its request."""
        head = self.requests.get(request_id)
        if head is None or index >= len(head.group) or head.group[index].finished:
            return False
        seq = head.group[index]
        self.scheduler.remove(seq)
        del seq.output_ids[keep:]
        if seq.logprobs is not None:
            del seq.logprobs[keep:]
        seq.finish(FinishReason.STOP, stop)
        if head.group_finished:
            del self.requests[request_id]
        return head.group_finished

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._flights)

    # ------------------------------------------------------------------ the loop

    def step(self) -> list[Sequence]:
        """Run one forward pass; return the sequences that got new tokens.

        A pipeline keeps up to `in_flight` batches going: a step launches its batch
        through the first stage, from the sequences no batch in flight holds, and returns
        the tokens of the oldest batch once that many are in flight (or when nothing new
        could start). Elsewhere each step's batch is done before it returns."""
        t0 = time.perf_counter()
        spec = self.speculator
        drafts = spec.propose(self.scheduler.running) if spec is not None else None
        busy = frozenset(item.seq for f in self._flights for item in f.out.scheduled)
        out = self.scheduler.schedule(drafts, busy, self.in_flight)
        if out.scheduled:
            try:
                items = [item for item in out.scheduled if item.sample]
                greedy = argmax_only([item.seq for item in items])
                self._flights.append(_Flight(out, self.runner.start(out.scheduled, greedy,
                                                                    out.copies)))  # fmt: skip
            except Exception:
                self._fail(out)
                raise
        if self._flights and (not out.scheduled or len(self._flights) >= self.in_flight):
            return self._finish(self._flights.popleft(), t0)
        self._launched_s += time.perf_counter() - t0
        if not self._flights:  # an idle step: nothing ran
            self._record(out, StepCounts(), 0.0)
        return []

    def _finish(self, flight: _Flight, t0: float) -> list[Sequence]:
        """The oldest batch in flight: its output taken, its tokens sampled."""
        out, counts = flight.out, StepCounts()
        try:
            forward = flight.result()
            for item in out.scheduled:
                # (a verify chunk's count waits for the verdict; an aborted one holds nothing)
                if not item.draft and not item.seq.finished:
                    self.blocks.computed(item.seq, item.n_tokens)
            for seq, first, rows in forward.prompt:
                seq.record_prompt_logprobs(first, rows)
            for seq, first, hidden in forward.pooled:
                seq.pool(first, hidden)
            sampled = sample_all(self, [item for item in out.scheduled if item.sample],
                                       forward, counts)  # fmt: skip
        except Exception:
            for f in (flight, *self._flights):  # the ranks' group is broken for all of them
                self._fail(f.out)
            self._flights.clear()
            raise
        self._record(out, counts, time.perf_counter() - t0)
        return sampled

    def _record(self, out: SchedulerOutput, counts: StepCounts, seconds: float) -> None:
        """A finished step in the log; its duration counts the calls that only launched
        since the last (so the durations add up to the time spent in step())."""
        duration, self._launched_s = seconds + self._launched_s, 0.0
        if self.speculator is not None:
            self.speculator.end_step(out.scheduled, self.scheduler.running, duration,
                                     counts.emitted)  # fmt: skip
        self.step_log.record(out, counts, duration, self.scheduler, self.blocks, self.block_bytes)

    def take_failures(self) -> dict[str, str]:
        """The requests that failed alone since the last call (id -> why), and forget them."""
        failed, self.failures = self.failures, {}
        return failed

    def _fail(self, out: SchedulerOutput) -> None:
        """The step raised (forward pass or sampling): abort the requests it touched, free
        their blocks and forget their prefix hashes, so the engine stays usable for everyone
        else."""
        for item in out.scheduled:
            self.blocks.forget_seq(item.seq)
        for item in out.scheduled:
            self.abort_request(item.seq.request_id)
