"""A `transformers` model behind the EngineFront interface (front/interface.py): for an
architecture the native engine lacks, or as a reference beside it. The server, its limits,
deadlines, metrics and both protocols take it as they take a core.

What it runs is transformers' own `generate`, one request at a time in a worker thread
(no batching, no paged KV, no prefix cache), its tokens streamed back through the same
detokenizer as a core's (stop strings, text). It supports temperature, top_p, top_k,
repetition_penalty, seed, max_tokens, stop strings and stop token ids; a request asking
for logprobs, prompt logprobs, n > 1, structured output, embeddings or a thinking budget
is refused with a 400 that says so.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tokenworks.engine.admission import Admission
from tokenworks.engine.detokenizer import RequestText
from tokenworks.engine.messages import (
    CompletionDelta,
    DeadlineExceededError,
    EngineNotRunningError,
    QueueFullError,
    RequestFailedError,
    RequestMetrics,
    RequestUpdate,
)
from tokenworks.engine.request import FinishReason, SamplingParams
from tokenworks.front.interface import EngineFront, Submission
from tokenworks.front.streams import RequestStream, Stream

log = logging.getLogger("tokenworks.engine")
UNSUPPORTED = (  # (the request asks for it, what to say)
    (lambda p: p.logprobs is not None, "logprobs"),
    (lambda p: p.prompt_logprobs is not None, "prompt_logprobs"),
    (lambda p: p.n > 1, "n > 1"),
    (lambda p: p.structured is not None, "structured output (or a forced tool choice)"),
    (lambda p: p.pooling is not None, "embeddings"),
    (lambda p: p.thinking is not None and p.thinking.budget is not None, "a thinking budget"),
    (lambda p: bool(p.logit_bias), "logit_bias"),
    (lambda p: p.max_tokens < 1, "max_tokens 0"),
)


class UnsupportedError(ValueError):
    """The transformers backend cannot do what the request asks (a 400)."""


@dataclass
class HFView:
    """What the server reads of the model: as engine_view.EngineView for a core."""

    spec: object  # vocab_size, hidden_size
    tokenizer: object
    max_model_len: int
    admission: Admission


@dataclass
class _Job:
    stream: Stream
    params: SamplingParams
    prompt_ids: list[int]
    deadline: float | None
    arrived: float
    cancelled: bool = False


def _source(model: str) -> tuple[str, dict]:
    """transformers' from_pretrained arguments for a model argument: a catalogue name or a
    .gguf file (read through transformers' GGUF support), a directory or a hub id."""
    from tokenworks.models import catalogue

    path = catalogue.pull(model) if model in catalogue.CATALOGUE else Path(model).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return str(path.parent), {"gguf_file": path.name}
    return model, {}


class HFFront(EngineFront):
    """EngineFront over transformers' generate (see the module docstring)."""

    def __init__(self, model: str, dtype: str = "float32", max_waiting: int = 256):
        self.model_name, self.dtype, self.max_waiting = model, dtype, max_waiting
        self.engine: HFView | None = None
        self.observer = None
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._live: dict[str, _Job] = {}
        self._lock = threading.Lock()
        self._worker: threading.Thread | None = None
        self._hf = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        if self._worker is not None:
            return
        import torch
        from transformers import AutoModelForCausalLM

        where, kw = _source(self.model_name)
        self._hf = AutoModelForCausalLM.from_pretrained(
            where, dtype=getattr(torch, self.dtype), **kw
        ).eval()
        self.engine = self._view(where, kw)
        self._worker = threading.Thread(target=self._run, name="transformers", daemon=True)
        self._worker.start()

    def _view(self, where: str, kw: dict) -> HFView:
        """The tokenizer the native engine would use where it reads the model (the same
        tokens), else transformers' own; the context from the model's config."""
        from tokenworks.tokenizer.tokenizer import TokenizerWrapper

        config = self._hf.config
        try:
            from tokenworks.models import load

            loaded = load(self.model_name, weights=False)
            tokenizer, spec = TokenizerWrapper.from_loaded(loaded), loaded.spec
        except Exception:  # an architecture the native loader does not read
            from transformers import AutoTokenizer

            hf_tok = AutoTokenizer.from_pretrained(where, **kw)
            eos = self._hf.generation_config.eos_token_id
            tokenizer = TokenizerWrapper(
                hf_tok.backend_tokenizer,
                bos_token_id=hf_tok.bos_token_id,
                eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos else []),
                chat_template=hf_tok.chat_template,
            )
            spec = config
        context = int(getattr(config, "max_position_embeddings", 4096))
        vocab = int(config.vocab_size)
        admission = Admission(vocab, context, "the model's max_position_embeddings",
                              num_blocks=-(-context // 16), block_size=16)  # fmt: skip
        return HFView(spec, tokenizer, context, admission)

    def shutdown(self) -> None:
        self.fail_all("the server is shutting down")
        if self._worker is not None:
            self._jobs.put(None)
            self._worker.join(timeout=30)
            self._worker = None

    def configure(self, observer=None, max_backlog=None, max_stall_s=None) -> None:
        self.observer = observer

    @property
    def is_running(self) -> bool:
        return self._worker is not None and self._worker.is_alive()

    def in_flight(self) -> int:
        return len(self._live)

    def fail_all(self, why: str) -> None:
        with self._lock:
            jobs, self._live = list(self._live.values()), {}
        for job in jobs:
            job.cancelled = True
            job.stream.push(EngineNotRunningError(why))

    # ------------------------------------------------------------------ requests

    async def submit(self, submission: Submission) -> RequestStream:
        params, prompt_token_ids = submission.params, submission.prompt_token_ids
        request_id, deadline = submission.request_id, submission.deadline
        if submission.kv_export or submission.kv_import is not None:
            raise UnsupportedError("the transformers backend moves no KV blocks")
        if submission.lora is not None:
            raise UnsupportedError("the transformers backend serves no LoRA adapters")
        if not self.is_running:
            raise EngineNotRunningError("the transformers backend is not running")
        asked = [what for test, what in UNSUPPORTED if test(params)]
        if asked:
            raise UnsupportedError(
                f"the transformers backend does not support {', '.join(asked)}; send it to "
                "a native model"
            )
        refusal = self.engine.admission.check(prompt_token_ids, params.max_tokens)
        if refusal is not None:
            raise refusal.error()
        if len(self._live) >= self.max_waiting:
            raise QueueFullError(f"{len(self._live)} requests are waiting (at most "
                                 f"{self.max_waiting}); retry later")  # fmt: skip
        rid = request_id or self.new_request_id()
        text = RequestText(params, self.engine.tokenizer, list(prompt_token_ids))
        stream = Stream(rid, asyncio.get_running_loop(), asyncio.Queue(), text)
        job = _Job(stream, params, list(prompt_token_ids), deadline, time.monotonic())
        with self._lock:
            self._live[rid] = job
        self._jobs.put(job)
        return RequestStream(self.abort, stream, deadline)

    def abort(self, request_id: str) -> None:
        with self._lock:
            job = self._live.pop(request_id, None)
        if job is not None:
            job.cancelled = True

    # ------------------------------------------------------------------ the worker

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if job.cancelled:
                continue
            try:
                self._generate(job)
            except Exception as e:
                log.exception("transformers failed on request %s", job.stream.request_id)
                job.stream.push(RequestFailedError(f"the transformers backend failed: {e}"))
            finally:
                with self._lock:
                    self._live.pop(job.stream.request_id, None)

    def _generate(self, job: _Job) -> None:
        import torch
        from transformers import StoppingCriteria, StoppingCriteriaList
        from transformers.generation.streamers import BaseStreamer

        p, stream, front = job.params, job.stream, self
        eos = [] if p.ignore_eos else list(self.engine.tokenizer.eos_token_ids)
        stops = eos + list(p.stop_token_ids)
        state = {"n": 0, "first": None, "last": None, "stopped": None, "stop_token": None}

        def send(token: int | None, reason: str | None, stop_reason=None) -> None:
            tokens = [] if token is None else [token]
            delta = CompletionDelta(0, "", tokens, None, reason, stop_reason)
            update = RequestUpdate(stream.request_id, [delta], reason is not None,
                                   len(job.prompt_ids), 0)  # fmt: skip
            with_text, stopped = stream.text.apply(update)
            if stopped:
                state["stopped"] = stopped[0]
            if with_text is not None:
                stream.pushed += len(tokens)
                stream.push(with_text)

        class Tokens(BaseStreamer):
            prompt_seen = False

            def put(self, value):
                if not self.prompt_seen:  # generate() hands the prompt over first
                    self.prompt_seen = True
                    return
                for token in value.reshape(-1).tolist():
                    now = time.monotonic()
                    if state["last"] is not None and front.observer is not None:
                        front.observer.on_inter_token(now - state["last"])
                    state["first"] = state["first"] or now
                    state["last"] = now
                    state["n"] += 1
                    if token in stops:
                        state["stop_token"] = token
                        continue
                    send(token, None)

            def end(self):
                pass

        class Cancelled(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                late = job.deadline is not None and time.monotonic() > job.deadline
                return job.cancelled or late or state["stopped"] is not None

        kw = {"do_sample": False}
        if p.temperature > 0:
            kw = {"do_sample": True, "temperature": p.temperature, "top_p": p.top_p,
                  "top_k": p.top_k if p.top_k > 0 else 0}  # fmt: skip
            if p.seed is not None:
                torch.manual_seed(p.seed)
        if p.repetition_penalty != 1.0:
            kw["repetition_penalty"] = p.repetition_penalty
        with torch.no_grad():
            self._hf.generate(
                torch.tensor([job.prompt_ids]),
                attention_mask=torch.ones(1, len(job.prompt_ids), dtype=torch.long),
                max_new_tokens=p.max_tokens,
                eos_token_id=stops or None,
                pad_token_id=stops[0] if stops else 0,
                streamer=Tokens(),
                stopping_criteria=StoppingCriteriaList([Cancelled()]),
                **kw,
            )
        if job.cancelled:
            return
        if job.deadline is not None and time.monotonic() > job.deadline:
            stream.push(DeadlineExceededError("the request did not finish before its deadline"))
            return
        if state["stopped"] is None:
            token = state["stop_token"]
            if token is not None:
                reason = (FinishReason.STOP, None if token in eos else token)
            else:
                reason = (FinishReason.LENGTH, None)
            send(None, *reason)
        if self.observer is not None:
            now = time.monotonic()
            self.observer.on_request_finished(RequestMetrics(
                request_id=stream.request_id,
                finish_reasons=[str(stream.text.reasons.get(0, "stop"))],
                prompt_tokens=len(job.prompt_ids), generation_tokens=state["n"], queue_time=0.0,
                ttft=state["first"] - job.arrived if state["first"] else None,
                e2e=now - job.arrived,
            ))  # fmt: skip
