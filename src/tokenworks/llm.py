"""The offline API: LLM(...).generate(prompts, params), .chat(messages, params) and
.embed(prompts)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from tqdm import tqdm

from tokenworks.config import EngineConfig
from tokenworks.engine.engine import LLMEngine
from tokenworks.engine.request import RequestOutput, SamplingParams
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
        self.config = EngineConfig.build(model=model, dtype=dtype, device=device, **kw)
        self.engine = LLMEngine(self.config, loaded, draft)
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = (
            params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        )
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} SamplingParams")
        self._check_own_loop()
        seqs = []
        for p, sp in zip(prompts, params_list, strict=True):
            if isinstance(p, str):
                seqs.append(self.engine.add_request(prompt=p, params=sp))
            else:
                seqs.append(self.engine.add_request(prompt_token_ids=list(p), params=sp))
        with tqdm(total=len(seqs), desc="generate", disable=not use_tqdm or len(seqs) < 2) as bar:
            done = 0
            while self.engine.has_unfinished():
                self.engine.step()
                now = sum(s.group_finished for s in seqs)
                bar.update(now - done)
                done = now
        self.engine.take_failures()  # their outputs say so: finish_reason "error"
        return [s.to_output() for s in seqs]

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

    def _check_own_loop(self) -> None:
        """One loop steps an engine: while a server's core thread runs this one, its
        requests go through that server."""
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
        seq = self.engine.add_request(prompt=prompt, params=params)
        try:
            while not seq.group_finished:
                if cancel is not None and cancel():
                    return
                self.engine.step()
                piece = seq.take_stream_text()
                if piece:
                    yield piece
            piece = seq.take_stream_text()
            if piece:
                yield piece
        finally:
            if not seq.group_finished:
                self.engine.abort_request(seq.request_id)
