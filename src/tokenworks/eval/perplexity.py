"""Perplexity on a text with a sliding window, the method transformers documents.

The text's tokens are cut into windows of `context` tokens whose starts are `stride` apart;
each window is one forward pass from position 0, and scores only the tokens the previous
window did not (its last `end - previous end` tokens, never its own first token, which has
no context). The perplexity is exp of the mean negative log-likelihood over every scored
token. With stride == context the windows do not overlap (fast, each token sees less
context on average); a smaller stride gives each scored token more context at more cost.
"""

from __future__ import annotations

import math
import time

import torch
from tqdm import tqdm

from tokenworks.engine.kv_pool import KVPool
from tokenworks.ops.attention import AttentionMetadata


def windows(n: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, scored) for each window over n tokens: the window is [begin, end) and
    its last `scored` tokens are scored (the first token of the text never is)."""
    out, prev_end = [], 0
    for begin in range(0, n, stride):
        end = min(begin + context, n)
        scored = min(end - prev_end, end - begin - 1)
        if scored > 0:
            out.append((begin, end, scored))
        prev_end = end
        if end == n:
            break
    return out


def perplexity(
    engine, ids: list[int], context: int | None = None, stride: int | None = None
) -> dict:
    """The perplexity of token ids under the engine's model (its weights, dtype and
    quantisation as built), through a paged pool of its own."""
    context = min(context or engine.max_model_len, engine.max_model_len)
    stride = stride or context
    if context < 2 or stride < 1 or stride > context:
        raise ValueError(
            f"context {context} and stride {stride}: need 2 <= context, 1 <= stride <= context"
        )
    if len(ids) < 2:
        raise ValueError("the text has fewer than 2 tokens: nothing to score")
    bs = engine.config.block_size
    pool = KVPool.for_spec(
        engine.spec,
        -(-context // bs),
        bs,
        engine.config.torch_dtype,
        engine.config.device,
        kv_dtype=engine.config.kv_cache_dtype,
    )
    table = list(range(pool.num_blocks))
    tokens = torch.tensor(ids, device=engine.config.device)
    nll_sum, scored_total = 0.0, 0
    spans = windows(len(ids), context, stride)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for begin, end, scored in tqdm(spans, desc="perplexity", unit="window"):
            n = end - begin
            meta = AttentionMetadata.paged([n], [0], [table], bs)
            positions = torch.arange(n, device=tokens.device)
            rows = torch.arange(n - 1 - scored, n - 1, device=tokens.device)  # predict the scored
            logits = engine.model(tokens[begin:end], positions, meta, pool, logits_rows=rows)
            logp = torch.log_softmax(logits.float(), dim=-1)
            target = tokens[begin + n - scored : end, None]
            nll_sum += float(-logp.gather(1, target).double().sum())
            scored_total += scored
    nll = nll_sum / scored_total
    return {
        "perplexity": math.exp(nll),
        "nll": nll,
        "tokens": scored_total,
        "text_tokens": len(ids),
        "context": context,
        "stride": stride,
        "windows": len(spans),
        "seconds": time.perf_counter() - t0,
    }
