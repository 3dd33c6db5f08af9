"""Lab: what a sliding window bounds, and what it does not.

Three measurements:

- reach: a window of W tokens on every one of a model's L layers lets a token influence
  positions at most L x (W - 1) after it, one window a layer. SmolLM2-135M (30 layers)
  is given such a window and run twice through the float64 reference, the second time
  with its first token changed; every position's logits are compared. Up to the reach
  they differ, past it they must be identical to the last bit;
- a window on a model not trained for one: SmolLM2-135M's perplexity on a text with a
  window of each size on every layer, beside Gemma 3 270M (trained with 512-token
  windows on five layers in six) as trained and with its windows removed;
- speed: Gemma 3 270M's decode step at long contexts with its windowed layers giving back
  the blocks behind the window (`--sliding-window-kv free`) and with the window only
  masking the scores (`mask`), both on the torch modules, and freeing on the C kernels
  (the default; the C pass declines masked windows, whose layers share one block table).

    python labs/sliding_window.py [--windows 32,64,128,256,512] [--contexts 1024,2048,4096]

Writes an evidence record and a PNG (influence by position; perplexity by window; decode
step by context).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from tokenworks import LLM  # noqa: E402
from tokenworks.bench.labs import parse_lab_args, save_figure  # noqa: E402
from tokenworks.bench.latency import decode_step_times  # noqa: E402
from tokenworks.bench.record import make_record, write_record  # noqa: E402
from tokenworks.bench.workload import latency_prompt  # noqa: E402
from tokenworks.eval.perplexity import perplexity  # noqa: E402
from tokenworks.models import load  # noqa: E402
from tokenworks.models.reference import forward  # noqa: E402

# the text the perplexities are taken on: English prose that ships with the checkout
TEXT = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def windowed(loaded, window: int | None):
    """loaded with `window` on every layer (None: no window on any)."""
    spec = dataclasses.replace(loaded.spec, sliding_window=window, window_layers=None)
    return dataclasses.replace(loaded, spec=spec)


def reach(loaded, window: int, tokens: int, seed: int) -> dict:
    """How far the first token's influence reaches, in the float64 reference."""
    source = windowed(loaded, window)
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, source.spec.vocab_size, tokens)
    changed = ids.copy()
    changed[0] = (ids[0] + 1) % source.spec.vocab_size
    a = forward(ids, source.weights, source.spec)
    b = forward(changed, source.weights, source.spec)
    diff = np.abs(a - b).max(-1)  # [tokens]
    touched = np.nonzero(diff)[0]
    bound = source.spec.n_layers * (window - 1)
    return {
        "window": window,
        "layers": source.spec.n_layers,
        "bound": bound,
        "furthest_influenced": int(touched.max()),
        "max_abs_diff_by_position": diff.tolist(),
        "identical_past_bound": bool((diff[bound + 1 :] == 0).all()),
        # where the change is still a thousandth of a logit: far short of the bound
        "furthest_over_a_thousandth": int(np.nonzero(diff > 1e-3)[0].max()),
    }


def ppl(source, model: str, ids_of, context: int, threads: int) -> float:
    llm = LLM(model, loaded=source, threads=threads, warmup=False, max_model_len=context)
    return perplexity(llm.engine, ids_of(llm.tokenizer), context, context)["perplexity"]


def untrained_window(model: str, windows: list[int], ids_of, context: int, threads: int) -> dict:
    loaded = load(model)
    out = {"none": ppl(loaded, model, ids_of, context, threads)}
    for w in tqdm(windows, desc=f"{model} windows", unit="window"):
        out[str(w)] = ppl(windowed(loaded, w), model, ids_of, context, threads)
    return out


def trained_window(model: str, ids_of, context: int, threads: int) -> dict:
    """A model trained with windows, as trained and with its windows wider than the
    context (the same layers keep their own RoPE base: only the window goes)."""
    loaded = load(model)
    spec = dataclasses.replace(loaded.spec, sliding_window=context + 1)
    return {
        "window": loaded.spec.sliding_window,
        "as_trained": ppl(loaded, model, ids_of, context, threads),
        "window_removed": ppl(
            dataclasses.replace(loaded, spec=spec), model, ids_of, context, threads
        ),  # fmt: skip
    }


SPEED_WAYS = {  # name -> (sliding_window_kv, kernels)
    "free_c": ("free", "auto"),  # the default: C kernels, each group its own block table
    "free_torch": ("free", "torch"),
    "mask_torch": ("mask", "torch"),  # one block table: the C pass declines mixed windows
}


def decode_speed(model: str, contexts: list[int], steps: int, threads: int) -> dict:
    out = {}
    for way, (kv, kernels) in SPEED_WAYS.items():
        llm = LLM(model, threads=threads, sliding_window_kv=kv, kernels=kernels,
                  enable_prefix_caching=False, max_model_len=max(contexts) + steps + 8)  # fmt: skip
        vocab = llm.engine.spec.vocab_size
        out[way] = {}
        for c in tqdm(contexts, desc=f"{model} decode, {way}", unit="context"):
            times = decode_step_times(llm.loop, [latency_prompt(c, vocab, seed=7)], steps)
            out[way][str(c)] = {"decode_step_s": statistics.median(times)}
        out[way]["engine"] = llm.config.to_dict()
        del llm
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="a model trained without windows")
    ap.add_argument("--windowed-model", default="gemma3-270m", help="one trained with them")
    ap.add_argument("--reach-windows", default="3,4", help="windows of the reach test")
    ap.add_argument("--reach-tokens", type=int, default=128)
    ap.add_argument("--windows", default="32,64,128,256,512", help="windows of the perplexity")
    ap.add_argument("--ppl-tokens", type=int, default=4096)
    ap.add_argument("--ppl-context", type=int, default=1024)
    ap.add_argument(
        "--contexts", default="1024,2048,4096", help="decode contexts of the speed test"
    )
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed per context")
    ap.add_argument("--text", default=str(TEXT), help="the text perplexity is taken on")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results")
    args = parse_lab_args(
        ap, fast=dict(reach_windows="2", reach_tokens=40, windows="16", ppl_tokens=128,
                      ppl_context=64, contexts="96", steps=2),
    )  # fmt: skip
    torch.set_num_threads(args.threads)
    text = Path(args.text).read_text(encoding="utf-8")

    def ids_of(tok):
        return tok.encode(text)[: args.ppl_tokens]

    small = load(args.model)
    reaches = {}
    for w in tqdm([int(x) for x in args.reach_windows.split(",")], desc="reach", unit="window"):
        reaches[str(w)] = r = reach(small, w, args.reach_tokens, args.seed)
        print(f"window {w} on {r['layers']} layers: the first token reaches position "
              f"{r['furthest_influenced']} (bound {r['bound']}); identical past it: "
              f"{r['identical_past_bound']}")  # fmt: skip
        if not r["identical_past_bound"] or r["furthest_influenced"] > r["bound"]:
            raise SystemExit(f"window {w}: influence past the bound of {r['bound']} tokens")
    del small
    windows = [int(x) for x in args.windows.split(",")]
    untrained = untrained_window(args.model, windows, ids_of, args.ppl_context, args.threads)
    print(f"{args.model} perplexity: " + ", ".join(f"window {k} {v:.2f}"
                                                   for k, v in untrained.items()))  # fmt: skip
    trained = trained_window(args.windowed_model, ids_of, args.ppl_context, args.threads)
    print(f"{args.windowed_model} perplexity: {trained['as_trained']:.2f} with its windows of "
          f"{trained['window']}, {trained['window_removed']:.2f} without")  # fmt: skip
    contexts = [int(x) for x in args.contexts.split(",")]
    speed = decode_speed(args.windowed_model, contexts, args.steps, args.threads)
    for c in contexts:
        ms = {way: speed[way][str(c)]["decode_step_s"] * 1e3 for way in SPEED_WAYS}
        speed[f"mask_over_free_torch_{c}"] = ms["mask_torch"] / ms["free_torch"]
        print(f"{args.windowed_model} decode at {c}: "
              + ", ".join(f"{way} {t:.1f} ms" for way, t in ms.items()))  # fmt: skip

    record = make_record(
        kind="lab.sliding_window",
        engine={
            "threads": args.threads,
            "reach": "float64 reference",
            "speed": speed["free_c"]["engine"],
            "speed_ways": SPEED_WAYS,
        },  # fmt: skip
        model={"ids": [args.model, args.windowed_model]},
        workload={
            "reach_windows": args.reach_windows,
            "reach_tokens": args.reach_tokens,
            "windows": windows,
            "ppl_tokens": args.ppl_tokens,
            "ppl_context": args.ppl_context,
            "contexts": contexts,
            "steps": args.steps,
            "text": os.path.relpath(args.text),
        },  # fmt: skip
        results={
            "reach": reaches,
            "untrained": untrained,
            "trained": trained,
            "speed": {k: v for k, v in speed.items() if k not in SPEED_WAYS}
            | {way: {c: speed[way][c] for c in map(str, contexts)} for way in SPEED_WAYS},
        },  # fmt: skip
        seeds=[args.seed],
    )
    path = write_record(record, args.out)

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(14, 4))
    for w, r in reaches.items():
        diff = np.maximum(np.array(r["max_abs_diff_by_position"]), 1e-18)
        a.plot(diff, label=f"window {w}: bound {r['bound']}")
        a.axvline(r["bound"], ls=":", color="grey")
    a.set(yscale="log", xlabel="position", ylabel="max |logit change| (1e-18: none)",
          title=f"the first token changed, {args.model}")  # fmt: skip
    a.legend(fontsize=7)
    ws = [k for k in untrained if k != "none"]
    b.plot([int(w) for w in ws], [untrained[w] for w in ws], "o-", label=f"{args.model}, windowed")
    b.axhline(untrained["none"], ls="--", label=f"{args.model}, no window")
    b.axhline(trained["as_trained"], ls="-.", color="g",
              label=f"{args.windowed_model} as trained")  # fmt: skip
    b.axhline(trained["window_removed"], ls=":", color="g",
              label=f"{args.windowed_model}, windows removed")  # fmt: skip
    b.set(xscale="log", yscale="log", xlabel="window (tokens, every layer)", ylabel="perplexity",
          title=f"{args.ppl_context}-token contexts")  # fmt: skip
    b.legend(fontsize=7)
    for way in SPEED_WAYS:
        c.plot(contexts, [speed[way][str(x)]["decode_step_s"] * 1e3 for x in contexts], "o-",
               label=way.replace("_", ", "))  # fmt: skip
    c.set(xlabel="context (tokens)", ylabel="decode step ms", title=args.windowed_model)
    c.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, args.out, path.with_suffix(".png").name)
    print(f"record: {path}")


if __name__ == "__main__":
    main()
