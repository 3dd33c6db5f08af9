"""ModelRunner: turns the scheduled sequences into one flat batch and runs it.

The batch runs on the C kernels where they are open for this engine and take it
(kernels/backend.py), else through the torch model over the same paged pool.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import torch

from tokenworks.engine.sampler import ForwardOutput
from tokenworks.engine.scheduler import ScheduledSeq
from tokenworks.kernels import CKernels
from tokenworks.models.pipeline import PipelineStage, micro_batches
from tokenworks.ops.attention import AttentionMetadata


def open_kernels(model, pool, config) -> tuple:
    """CKernels.open for a model over its pool with an EngineConfig's kernel options:
    (the kernels or None, why not)."""
    if config.tensor_parallel_size * config.pipeline_parallel_size > 1:
        return None, "tensor and pipeline parallelism run the torch modules, split"
    if config.attention_tile is not None:
        return None, "attention_tile runs the torch path's tiled attention"
    if config.compile:
        return None, "compile runs the torch modules, compiled"
    return CKernels.open(
        model,
        pool,
        config.block_size,
        kernels=config.kernels,
        device=config.device,
        # an adapter's products sum as torch's matmuls do, which depends on the batch
        batch_invariant=config.batch_invariant is not False and not config.enable_lora,
        packed_products=config.packed_products,
        amx_tiles=config.amx_tiles,
    )


class TorchStep(msgspec.Struct):
    """What one torch forward of a step needs: the flat batch's tokens and positions, each
    chunk's rows and context, its block tables (one per KV group), the rows that want
    logits, and (embeddings) the rows whose hidden states are kept. Tensor-parallel workers
    receive it as it is and run the same forward on their shards (engine/workers.py)."""

    ids: list[int]
    positions: list[int]
    query_lens: list[int]
    context_lens: list[int]
    tables: list[list[list[int]]]
    head_rows: list[int]
    hidden_rows: list[int] | None = None
    copies: list[tuple[int, int]] = []  # (from, to) blocks copied before the forward
    micro_batches: int = 1  # the parts a pipeline cuts it into (every stage alike)


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        pool,  # engine.kv_pool.KVPool
        block_size: int,
        device: str,
        batch_decode: bool = True,
        kernels=None,  # kernels.CKernels, or None: the torch model runs every batch
        rows_up_to: int = 0,  # chunks this short run as decode rows (see rows_as_decodes)
        compile_stats=None,  # models.compiled.CompileStats where the layers are compiled
        workers=None,  # engine.workers.WorkerRanks: each torch step is sent to them first
        micro_batches: int = 1,  # rank 0 of a pipeline: each step runs in this many parts
    ):
        self.model, self.pool, self.block_size = model, pool, block_size
        self.workers, self.micro_batches = workers, micro_batches
        self.device, self.batch_decode = device, batch_decode
        self.kernels = kernels
        self.lora = None  # the engine's LoRA adapters (engine/lora.py), where it serves any
        self.rows_up_to = rows_up_to
        self.compile_stats = compile_stats
        layout = pool.layout
        self._group_of = [layout.group_of(i) for i in range(layout.n_layers)]  # per layer

    def run(
        self, batch: list[ScheduledSeq], argmax_only: bool = False, copies: list = ()
    ) -> ForwardOutput:
        """Feed each sequence its scheduled tokens; return the logits [sampling rows, V] of
        the sequences whose chunk reaches their last token (the others are mid-prompt and
        sample nothing yet; a verify chunk has 1 + k rows), in batch order and in the
        dtype the model computes them.
        argmax_only: every sampling row is plain greedy, and a forward path that can may
        hand back each row's argmax instead (the C decode step writes no logits then).
        copies: (from, to) pool blocks to copy first (the scheduler's copy-on-write)."""
        return self.start(batch, argmax_only, copies)()

    @torch.inference_mode()
    def start(
        self, batch: list[ScheduledSeq], argmax_only: bool = False, copies: list = ()
    ) -> Callable[[], ForwardOutput]:
        """run(), launched: the batch goes into the model now, and the function returned
        gives its output. A pipeline's first stage returns once its own part is done, so
        the next batch can start while the later stages finish this one; everywhere else
        the forward is over when this returns."""
        ids, positions, q_lens, ctx_lens, tables, last_rows = [], [], [], [], [], []
        # rows for prompt logprobs and for embeddings: (sequence, the rows' positions, the
        # flat row of the first)
        prompt_rows, pooled_rows = [], []
        end, slots = 0, []
        for item in batch:
            s, n, draft = item.seq, item.n_tokens, item.draft
            if self.lora is not None:  # each row's adapter (engine/lora_layers.py)
                slots.extend([self.lora.slot_of(s.lora)] * n)
            for rows_of, found in ((s.prompt_rows, prompt_rows), (s.pooled_rows, pooled_rows)):
                wanted = rows_of(n) if not draft else range(0)
                if wanted:
                    found.append((s, wanted, end + wanted.start - s.n_cached))
            ids.extend(s.ids_between(s.n_cached, s.n_cached + n - len(draft)))
            ids.extend(draft)
            positions.extend(range(s.n_cached, s.n_cached + n))
            q_lens.append(n)
            ctx_lens.append(s.n_cached)
            tables.append(s.block_tables)
            end += n
            if item.sample:  # a verify chunk: a row for its last real token and each guess
                last_rows.extend(range(end - 1 - len(draft), end))
        short = self.rows_up_to
        split = [bool(it.draft) or 1 < n <= short for it, n in zip(batch, q_lens, strict=True)]
        if any(split):
            q_lens, ctx_lens, tables = rows_as_decodes(split, q_lens, ctx_lens, tables)
        ids_t = torch.tensor(ids, device=self.device)
        pos_t = torch.tensor(positions, device=self.device)
        head_rows = _rows(last_rows, prompt_rows)  # ascending, where any prompt rows join
        if prompt_rows or pooled_rows:
            argmax_only = False
        if self.lora is not None:  # (read by the C pass's products too)
            self.lora.rows.set(slots, self.device)
        if self.kernels is not None and not pooled_rows:  # C hands back no hidden states
            layout = self.kernels.layout(q_lens, ctx_lens, tables)
            if layout is not None:
                self.pool.copy_blocks(list(copies))
                rows = torch.tensor(head_rows, dtype=torch.long, device=self.device)
                out = ForwardOutput(*self.kernels.forward(ids_t, pos_t, layout, rows, argmax_only))
                return lambda: _with_prompt_rows(out, head_rows, last_rows, prompt_rows)
        hidden_rows = _rows(head_rows, pooled_rows) if pooled_rows else None
        step = TorchStep(
            ids=ids, positions=positions, query_lens=q_lens, context_lens=ctx_lens, tables=tables,
            head_rows=head_rows, hidden_rows=hidden_rows, copies=list(copies),
            micro_batches=self.micro_batches,
        )  # fmt: skip
        later = self._run_step(step, ids_t, pos_t)

        @torch.inference_mode()
        def finish() -> ForwardOutput:
            logits, h = later()
            out = ForwardOutput(logits)
            if pooled_rows:
                at = {r: i for i, r in enumerate(hidden_rows)}
                out.pooled = [(s, w.start, h[at[r] : at[r] + len(w)]) for s, w, r in pooled_rows]
            return _with_prompt_rows(out, head_rows, last_rows, prompt_rows)

        return finish

    def _run_step(self, step: TorchStep, ids, positions) -> Callable[[], tuple]:
        """launch(), the tensor-parallel workers sent the step first where there are any:
        a failure then (launching it or collecting it) leaves their group broken, and says
        so for every later step."""
        if self.workers is None:
            return self.launch(step, ids, positions)
        self.workers.send(step)
        try:
            later = self.launch(step, ids, positions)
        except Exception as e:
            raise self.workers.fail(e) from e

        def result() -> tuple:
            try:
                return later()
            except Exception as e:
                raise self.workers.fail(e) from e

        return result

    def execute(self, step: TorchStep, ids=None, positions=None) -> tuple:
        """The torch forward of a step: (logits of its head rows, the hidden states of its
        hidden rows or None); ids, positions: the step's as tensors, where made already."""
        return self.launch(step, ids, positions)()

    @torch.inference_mode()
    def launch(self, step: TorchStep, ids=None, positions=None) -> Callable[[], tuple]:
        """execute(), started: the function returned gives its result (a pipeline stage's
        logits arrive from the last stage; elsewhere the forward is done already)."""
        self.pool.copy_blocks(step.copies)
        if ids is None:
            ids = torch.tensor(step.ids, device=self.device)
            positions = torch.tensor(step.positions, device=self.device)
        if isinstance(self.model, PipelineStage):
            logits = self._pipelined(step, ids, positions)
            return lambda: (logits(), None)
        meta = self.metadata(step.query_lens, step.context_lens, step.tables)
        rows = torch.tensor(step.head_rows, dtype=torch.long, device=self.device)
        if step.hidden_rows is None:
            done = self._forward(ids, positions, meta, rows), None
            return lambda: done
        h = self.model.final_hidden(ids, positions, meta, self.pool, step.hidden_rows)
        at = {r: i for i, r in enumerate(step.hidden_rows)}
        done = self.model.head(h[[at[r] for r in step.head_rows]]), h
        return lambda: done

    def _pipelined(self, step: TorchStep, ids, positions) -> Callable[[], torch.Tensor | None]:
        """A step through a pipeline stage, in micro-batches of whole chunks; the function
        returned gives the logits of its head rows on rank 0 (once the last stage has sent
        them) and on the last stage, None on the other ranks."""
        if step.hidden_rows is not None:
            raise ValueError(
                "embeddings do not run with pipeline parallelism (the hidden states stay on "
                "the last stage): use --pipeline-parallel-size 1"
            )
        logits = []
        for mb in micro_batches(step.query_lens, step.head_rows, step.micro_batches):
            c = slice(mb.chunks.start, mb.chunks.stop)
            meta = self.metadata(step.query_lens[c], step.context_lens[c], step.tables[c])
            rows = torch.tensor(mb.head_rows, dtype=torch.long, device=self.device)
            out = self.model(ids[mb.start : mb.end], positions[mb.start : mb.end], meta,
                             self.pool, logits_rows=rows, float_logits=False)  # fmt: skip
            if out is not None:
                logits.append(out)
        flight, dtype = self.model.launched(), self.pool.dtype

        @torch.inference_mode()
        def collect() -> torch.Tensor | None:
            first = self.model.collect(flight, dtype)
            return first if first is not None else torch.cat(logits) if logits else None

        return collect

    def _forward(self, ids, positions, meta, rows) -> torch.Tensor:
        def run():
            return self.model(ids, positions, meta, self.pool, logits_rows=rows, float_logits=False)

        if self.compile_stats is None:
            return run()
        return self.compile_stats.around(len(ids), run)

    def metadata(self, query_lens, context_lens, tables) -> AttentionMetadata:
        """The batch's attention metadata, one per KV group of the pool (tables: each
        sequence's block tables, one per group)."""
        kv = self.pool.layout
        metas = [
            AttentionMetadata.paged(
                query_lens,
                context_lens,
                [t[g] for t in tables],
                self.block_size,
                self.device,
                self.batch_decode,
                window,
            )
            for g, window in enumerate(kv.windows)
        ]
        return AttentionMetadata.grouped(metas, self._group_of)

    @torch.inference_mode()
    def run_uncached(self, token_ids: list[int]) -> torch.Tensor:
        """The whole sequence, no cache: logits for every position [n, V] (the slow oracle)."""
        n = len(token_ids)
        return self.model(
            torch.tensor(token_ids, device=self.device),
            torch.arange(n, device=self.device),
            AttentionMetadata.single(n),
            None,
        )


def _with_prompt_rows(out: ForwardOutput, head_rows, last_rows, prompt_rows) -> ForwardOutput:
    """out, its logits cut to the sampling rows where prompt-logprob rows came with them
    (those go to out.prompt: each sequence, its first position, its rows)."""
    if prompt_rows:
        at = {r: i for i, r in enumerate(head_rows)}
        logits = out.logits
        out.logits = logits[[at[r] for r in last_rows]]
        out.prompt = [(s, w.start + 1, logits[at[r] : at[r] + len(w)]) for s, w, r in prompt_rows]
    return out


def _rows(rows: list[int], extra: list[tuple]) -> list[int]:
    """rows and every row of the (sequence, positions, first row) runs in extra, ascending
    (rows alone, unsorted, where extra is empty)."""
    if not extra:
        return rows
    return sorted({*rows, *(r + j for _, w, r in extra for j in range(len(w)))})


def rows_as_decodes(split, query_lens, context_lens, tables) -> tuple[list, list, list]:
    """The batch with each chunk marked in split (speculative decoding's verify chunks, a
    drafter's short catch-ups) laid out as one decode row per token: row j attends to the
    context and the chunk's rows up to j, read through the block table like any decode
    token (every row's K/V is in the pool before any row attends). A few sequences
    verifying a few guesses each then run as a decode batch (the whole step in C, or
    batched decode attention in torch) instead of one prompt chunk each."""
    q, ctx, tab = [], [], []
    for cut, n, c, t in zip(split, query_lens, context_lens, tables, strict=True):
        if cut:
            q += [1] * n
            ctx += range(c, c + n)
            tab += [t] * n
        else:
            q.append(n)
            ctx.append(c)
            tab.append(t)
    return q, ctx, tab
