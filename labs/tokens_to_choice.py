"""Lab: from text to one chosen token, stage by stage, on the real model.

A completion passes through six stages, each timed here (the median of R repeats) and
each checked against a computation that does not share its code:

- tokenise: text -> ids; the ids decode back to the text;
- embed: ids -> one row of hidden_size numbers each; the rows equal gguf-py's
  dequantisation of the file's own blocks (or the file's floats);
- score: the forward pass over the prompt -> one score (logit) per vocabulary entry for
  the next position; the scores equal the float64 reference on the same weights, to the
  float32 path's rounding, with the same best token;
- normalise: scores -> probabilities (softmax); they sum to 1;
- choose: probabilities -> one token, greedy (the argmax) or sampled (temperature and
  top-p); N draws of the sampler follow the distribution it says it draws from (total
  variation within the sampling noise of N draws);
- detokenise: the chosen ids -> text again.

    python labs/tokens_to_choice.py [--model smollm2-135m] [--repeats 20] [--draws 4000]

Writes an evidence record and a PNG (milliseconds per stage, log scale). Exits 1 if a
check fails.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from tokenworks import LLM, SamplingParams  # noqa: E402
from tokenworks.bench.labs import parse_lab_args, save_figure  # noqa: E402
from tokenworks.bench.record import make_record, model_record, write_record  # noqa: E402
from tokenworks.engine.sampler import distribution, sample_one  # noqa: E402
from tokenworks.kernels.block_linear import dense  # noqa: E402
from tokenworks.kernels.blocks import BlockTensor  # noqa: E402
from tokenworks.models import load, reference  # noqa: E402
from tokenworks.ops.attention import AttentionMetadata  # noqa: E402

TEXT = (
    "A model never sees letters. The text is cut into pieces it has a number for, each "
    "number picks a row of a table, and after many layers the last row becomes one score "
    "for every piece it knows. Which piece comes next is then a matter of choosing."
)


def median_ms(fn, repeats: int) -> tuple[float, object]:
    """The median milliseconds of fn() over repeats calls (after one untimed), and its
    last result."""
    out = fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(1000 * (time.perf_counter() - t))
    return statistics.median(times), out


def file_rows(table, ids: list[int]) -> np.ndarray:
    """The embedding rows of ids as gguf-py dequantises the file's blocks (float32)."""
    if not isinstance(table, BlockTensor):
        return dense(table)[ids].float().numpy()
    import gguf

    raw = table.rows(torch.tensor(ids)).data.numpy()
    kind = gguf.GGMLQuantizationType(table.ggml_type)
    return gguf.quants.dequantize(raw, kind).reshape(len(ids), -1).astype(np.float32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--draws", type=int, default=4000, help="sampled tokens for the check")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results")
    args = parse_lab_args(ap, fast=dict(repeats=2, draws=500))
    torch.set_num_threads(args.threads)

    loaded = load(args.model)
    # float32 on the dequantised weights: the path the float64 reference checks exactly
    llm = LLM(args.model, dtype="float32", quantization="none", loaded=loaded,
              threads=args.threads, warmup=False)  # fmt: skip
    tok, model, spec = llm.tokenizer, llm.engine.model, loaded.spec
    stages, checks = {}, {}

    ms, ids = median_ms(lambda: tok.encode(TEXT), args.repeats)
    back = tok.decode(ids)
    stages["tokenise"] = ms
    checks["ids decode back to the text"] = back.strip() == TEXT
    ids_t = torch.tensor(ids)

    with torch.inference_mode():
        ms, rows = median_ms(lambda: model.embed(ids_t), args.repeats)
        stages["embed"] = ms
        want = file_rows(loaded.weights["model.embed_tokens.weight"], ids)
        embed_diff = float(np.abs(rows.float().numpy() - want).max())
        checks["rows equal gguf-py's dequantisation"] = embed_diff == 0.0

        n = len(ids)
        last = torch.tensor([n - 1])

        def score():
            return model(ids_t, torch.arange(n), AttentionMetadata.single(n), None,
                         logits_rows=last)[0]  # fmt: skip

        ms, logits = median_ms(score, max(1, args.repeats // 4))
        stages["score"] = ms
    oracle = reference.forward(np.array(ids), loaded.weights, spec)[-1]
    score_diff = float(np.abs(logits.double().numpy() - oracle).max())
    checks["scores equal the float64 reference"] = score_diff < 1e-3 * np.abs(oracle).max()
    checks["the best token is the reference's"] = int(logits.argmax()) == int(oracle.argmax())

    ms, probs = median_ms(lambda: logits.softmax(-1), args.repeats)
    stages["normalise"] = ms
    checks["probabilities sum to 1"] = abs(float(probs.sum()) - 1.0) < 1e-5
    entropy = float(-(probs * probs.clamp_min(1e-30).log()).sum())
    top = torch.topk(probs, 5)
    best = [(tok.decode([int(i)]), float(p)) for p, i in zip(top.values, top.indices, strict=True)]

    empty = torch.empty(0, dtype=torch.long)
    greedy = SamplingParams(temperature=0)
    sampled = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=0)
    gen = torch.Generator().manual_seed(0)
    ms, choice = median_ms(lambda: sample_one(logits, greedy, ids_t, empty, None), args.repeats)
    stages["choose_greedy"] = ms
    checks["greedy takes the argmax"] = choice.token_id == int(logits.argmax())
    ms, _ = median_ms(lambda: sample_one(logits, sampled, ids_t, empty, gen), args.repeats)
    stages["choose_sampled"] = ms
    target = distribution(logits, sampled)
    counts = torch.zeros_like(target)
    for _ in range(args.draws):
        counts[sample_one(logits, sampled, ids_t, empty, gen).token_id] += 1
    support = int((target > 0).sum())
    tv = 0.5 * float((counts / args.draws - target).abs().sum())
    noise = math.sqrt(support / args.draws)  # the scale of TV between N draws and their law
    checks["draws follow the sampler's distribution"] = tv <= noise

    chosen = [choice.token_id] + [int(i) for i in top.indices[1:]]
    ms, text = median_ms(lambda: tok.decode(chosen), args.repeats)
    stages["detokenise"] = ms

    checks = {name: bool(ok) for name, ok in checks.items()}
    summary = {
        "characters": len(TEXT),
        "tokens": n,
        "characters_per_token": len(TEXT) / n,
        "embed_max_abs_diff": embed_diff,
        "score_max_abs_diff": score_diff,
        "entropy_nats": entropy,
        "top5": best,
        "sampled_support": support,
        "total_variation": tv,
        "noise_scale": noise,
        "score_share_of_total": stages["score"] / sum(stages.values()),
    }
    for name, value in stages.items():
        print(f"{name:18s} {value:10.4f} ms")
    for name, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    print(f"{n} tokens for {len(TEXT)} characters; next token: {best[0][0]!r} "
          f"(p {best[0][1]:.3f}); sampled TV {tv:.4f} (noise {noise:.4f})")  # fmt: skip
    record = make_record(
        kind="lab.tokens_to_choice",
        engine=llm.config.to_dict(),
        model=model_record(llm),
        workload={
            "text": TEXT,
            "repeats": args.repeats,
            "draws": args.draws,
            "temperature": args.temperature,
            "top_p": args.top_p,
        },
        results={"stages_ms": stages, "checks": checks, "summary": summary},
        seeds=[0],
    )
    path = write_record(record, args.out)

    fig, ax = plt.subplots(figsize=(8, 3.6))
    names = list(stages)
    ax.barh(names[::-1], [stages[k] for k in names[::-1]], color="#4477aa")
    ax.set_xscale("log")
    ax.set(xlabel="milliseconds (median)",
           title=f"{args.model}: {n} tokens of text to one chosen token (float32)")  # fmt: skip
    fig.tight_layout()
    save_figure(fig, args.out, path.with_suffix(".png").name)
    print(f"record: {path}")
    if not all(checks.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
