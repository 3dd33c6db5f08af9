"""The offline API: LLM(...).generate(prompts, params), .chat(messages, params) and
.embed(prompts)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Iterator

from tqdm import tqdm

from tokenworks.config import EngineConfig
from tokenworks.engine.engine import LLMEngine
from tokenworks.engine.loop import EngineLoop, LocalInbox
from tokenworks.engine.request import (
    CompletionOutput,
    FinishReason,
    RequestOutput,
    SamplingParams,
)
from tokenworks.front.interface import Submission
from tokenworks.models.loaded import LoadedModel


class LLM:
    """Load a model once, then generate for many prompts in continuous batches.

    >>> llm = LLM("smollm2-135m", dtype="float32")
    >>> llm.generate(["Once upon a time"], SamplingParams(max_tokens=16, temperature=0))
    """

    def __init__(
        self,
        model: str = "smollm2-135m",
        dtype: str = "auto",
        device: str = "cpu",
        loaded: LoadedModel | None = None,
        draft: LoadedModel | None = None,
        **kw,
    ):
        """kw: any EngineConfig field (speculative_config: a dict or JSON string). `loaded`
        reuses weights already read by `load()`; `draft`, a drafter's, for speculation."""
        self.config = EngineConfig(model=model, dtype=dtype, device=device, **kw)
        self.engine = LLMEngine(self.config, loaded, draft)
        self.loop = EngineLoop(self.engine)  # outputs unsent: the sequences are at hand
        self.tokenizer = self.engine.tokenizer
        self.front = None

    @classmethod
    def over(cls, front) -> LLM:
        """An LLM whose generate() and chat() go through an engine front (front/interface.py)
        instead of an engine of its own: front/hf_front.py's HFFront (transformers'
        generate), a CoreClient of a core elsewhere, a ReplicaRouter. Started here.

        >>> llm = LLM.over(HFFront("smollm2-135m"))
        """
        llm = cls.__new__(cls)
        front.start()
        llm.config, llm.engine, llm.loop, llm.front = None, None, None, front
        llm._ids = itertools.count()  # its requests' ids
        llm.tokenizer = front.engine.tokenizer
        return llm

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora: str | list[str | None] | None = None,
    ) -> list[RequestOutput]:
        """lora: the LoRA adapter each prompt runs with (one name for all, or a list; None:
        the base model), loaded with --lora-modules or engine.lora.load()."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        loras = lora if isinstance(lora, list) else [lora] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(loras)} LoRA adapters")
        params_list = (
            params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        )
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} SamplingParams")
        if self.front is not None:
            return asyncio.run(self._through_front(prompts, params_list, loras))
        self._check_own_loop()
        heads: list = []
        try:
            for p, sp, name in zip(prompts, params_list, loras, strict=True):
                heads.append(self._add(p, sp, name))
        except Exception:  # nothing half-queued stays behind
            for head in heads:
                self.loop.abort(head.request_id)
            raise

        def unfinished() -> bool:
            return any(not h.group_finished for h in heads)

        with tqdm(total=len(heads), desc="generate", disable=not use_tqdm or len(heads) < 2) as bar:
            for _ in self.loop.turns(LocalInbox(), unfinished):
                bar.update(sum(h.group_finished for h in heads) - bar.n)
        return [h.to_output() for h in heads]

    def _add(self, prompt: str | list[int], params: SamplingParams | None, lora=None):
        """Queue one prompt on the loop; its first sequence."""
        if isinstance(prompt, str):
            return self.loop.add_request(self.tokenizer.encode(prompt), params, prompt, lora=lora)
        return self.loop.add_request(prompt, params, lora=lora)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One conversation (a list of {'role', 'content'}) or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.render_chat(c) for c in conversations]
        return self.generate(prompts, params, use_tqdm)

    def embed(
        self, prompts: str | list[str] | list[list[int]], pooling: str = "mean", use_tqdm=True
    ) -> list[list[float]]:
        """Each prompt's embedding: its final hidden states pooled ("mean" or "last") and
        scaled to unit length, the prompts batched like any requests."""
        params = SamplingParams(max_tokens=0, pooling=pooling)
        return [o.embedding for o in self.generate(prompts, params, use_tqdm)]

    async def _through_front(self, prompts, params_list, loras) -> list[RequestOutput]:
        """Every prompt submitted to the front at once; each request's updates gathered."""

        async def one(prompt, params: SamplingParams, lora) -> RequestOutput:
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            request_id = f"llm-{next(self._ids)}"
            text: dict[int, str] = {}
            tokens: dict[int, list[int]] = {}
            ends: dict[int, tuple] = {}
            job = Submission(params, ids, request_id=request_id, lora=lora)
            async for update in self.front.generate(job):
                for d in update.deltas:
                    text[d.index] = text.get(d.index, "") + d.text
                    tokens.setdefault(d.index, []).extend(d.token_ids)
                    if d.finish_reason is not None:
                        ends[d.index] = (FinishReason(d.finish_reason), d.stop_reason)
            outputs = [
                CompletionOutput(k, text[k], tokens[k], *ends.get(k, (None, None)))
                for k in sorted(text)
            ]
            prompt_text = prompt if isinstance(prompt, str) else None
            return RequestOutput(request_id, prompt_text, ids, outputs, finished=True)

        return list(await asyncio.gather(*(
            one(p, sp, name) for p, sp, name in zip(prompts, params_list, loras, strict=True)
        )))  # fmt: skip

    def _check_own_loop(self) -> None:
        """One loop steps an engine: while a server's core thread runs this one, its
        requests go through that server."""
        if self.engine is None:
            raise RuntimeError("an LLM over an engine front generates through generate()")
        if self.engine.core_thread:
            raise RuntimeError(
                "this LLM's engine is served by a core thread (a server over llm.engine): "
                "send the requests to that server, or build another LLM on the same weights "
                "(LLM(name, loaded=...))"
            )

    def render_chat(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def stream(
        self,
        prompt: str,
        params: SamplingParams | None = None,
        cancel: Callable[[], bool] | None = None,
    ) -> Iterator[str]:
        """Yield text pieces of one completion as they are generated. cancel: asked after
        every step; when it says True the request is aborted and the stream ends."""
        self._check_own_loop()
        head = self._add(prompt, params)

        def going() -> bool:
            return not head.group_finished and not (cancel is not None and cancel())

        try:
            for _ in self.loop.turns(LocalInbox(), going):
                piece = head.take_stream_text()
                if piece:
                    yield piece
            piece = head.take_stream_text()
            if piece:
                yield piece
        finally:
            if not head.group_finished:
                self.loop.abort(head.request_id)
