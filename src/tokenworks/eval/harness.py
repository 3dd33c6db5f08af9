"""lm-evaluation-harness in-process: `TokenworksLM(llm)` is an lm-eval model over an
`LLM`, so a task scores on the engine without a server:

    import lm_eval
    from tokenworks import LLM
    from tokenworks.eval.harness import TokenworksLM

    lm_eval.simple_evaluate(model=TokenworksLM(LLM("smollm2-135m")), tasks=[...])

A (context, continuation) pair is split into tokens as lm-eval's API models split it
(the context's trailing spaces go with the continuation; the continuation is what the whole
adds to the context's tokens), so the figures equal `local-completions` through
`tokenworks serve`. Needs the eval extra: `pip install 'tokenworks[eval]'`.
"""

from __future__ import annotations

import time

from lm_eval.api.model import LM

from tokenworks.engine.request import SamplingParams


def split_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], int]:
    """The pair's tokens and how many of them are the context's."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    return whole, len(tokenizer.encode(context, add_special_tokens=False))


class TokenworksLM(LM):
    def __init__(self, llm):
        super().__init__()
        self.llm = llm
        self.seconds = 0.0  # spent in the engine's calls (the rest is lm-eval's own)

    def _generate(self, prompts, params) -> list:
        t0 = time.perf_counter()
        try:
            return self.llm.generate(prompts, params, use_tqdm=False)
        finally:
            self.seconds += time.perf_counter() - t0

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        """Each continuation's log-likelihood and whether greedy decoding would give it,
        the pairs batched through the engine (prompt logprobs, nothing generated)."""
        tok = self.llm.tokenizer
        pairs = [split_pair(tok, *r.args) for r in requests]
        params = SamplingParams(max_tokens=0, prompt_logprobs=0)
        outs = self._generate([whole for whole, _ in pairs], params)
        found = []
        for (_, n_context), out in zip(pairs, outs, strict=True):
            scored = out.prompt_logprobs[max(n_context, 1) :]
            found.append((sum(lp.logprob for lp in scored), all(lp.rank == 1 for lp in scored)))
        return found

    def loglikelihood_rolling(self, requests) -> list[float]:
        """Each text's log-likelihood, every token after the first scored."""
        params = SamplingParams(max_tokens=0, prompt_logprobs=0)
        tok = self.llm.tokenizer
        texts = [tok.encode(r.args[0]) for r in requests]
        outs = self._generate(texts, params)
        return [sum(lp.logprob for lp in out.prompt_logprobs[1:]) for out in outs]

    def generate_until(self, requests) -> list[str]:
        """Greedy text (or as gen_kwargs ask) up to the first of `until`."""
        prompts, params = [], []
        for r in requests:
            context, kwargs = r.args
            until = kwargs.get("until") or []
            params.append(
                SamplingParams(
                    max_tokens=int(kwargs.get("max_gen_toks", 256)),
                    temperature=float(kwargs.get("temperature", 0.0)),
                    stop=[until] if isinstance(until, str) else list(until),
                )
            )
            prompts.append(context)
        return [o.outputs[0].text for o in self._generate(prompts, params)]
