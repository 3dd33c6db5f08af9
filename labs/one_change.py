"""Lab: where the model ends and the runtime begins, found by changing one thing at a time.

One real model (SmolLM2-135M) and one workload (a few prompts, greedy), run once as the
engine's defaults and then with exactly one thing changed. Each change is one of three
kinds:

- schedule: how the work is cut up and stored, the arithmetic left as it is (block size,
  one sequence at a time, prompt chunks, prefix caching);
- arithmetic: a runtime choice that orders or rounds the same arithmetic differently (the
  kernels, batch invariance off, the KV cache's type, the weights dequantised, float32);
- model: what is computed (RoPE's base, a window on every layer).

For each: whether the greedy tokens are the baseline's, where they first part, how far the
first token's log-probability moved, and the time, the KV bytes a token and the kernels
that ran. Then what the stack does when asked for what it cannot do: each impossible ask,
whether it is refused, in how long, with what message, and whether any work was done.

    python labs/one_change.py [--tokens 24]

Writes an evidence record and a PNG (tokens kept and time, by change).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from tokenworks import LLM, SamplingParams  # noqa: E402
from tokenworks.bench.labs import parse_lab_args, save_figure  # noqa: E402
from tokenworks.bench.record import make_record, write_record  # noqa: E402
from tokenworks.models import load  # noqa: E402

TEXT = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"

CHANGES = {  # name -> (kind, engine options, spec change)
    "kernels_torch": ("arithmetic", {"kernels": "torch"}, None),
    "block_size_64": ("schedule", {"block_size": 64}, None),
    "one_sequence_at_a_time": ("schedule", {"max_num_seqs": 1}, None),
    "prompt_chunks_of_16": ("schedule", {"max_num_batched_tokens": 16}, None),
    "prefix_caching_off": ("schedule", {"enable_prefix_caching": False}, None),
    "batch_invariance_off": ("arithmetic", {"batch_invariant": False}, None),
    "kv_cache_int8": ("arithmetic", {"kv_cache_dtype": "int8"}, None),
    "weights_dequantised": ("arithmetic", {"quantization": "none"}, None),
    "float32": ("arithmetic", {"dtype": "float32"}, None),
    "rope_base_doubled": ("model", {}, lambda s: {"rope_theta": 2 * s.rope_theta}),
    "window_of_16": ("model", {}, lambda s: {"sliding_window": 16, "window_layers": None}),
}


def run(model: str, loaded, options: dict, prompts: list[list[int]], tokens: int, threads: int):
    t0 = time.perf_counter()
    llm = LLM(model, loaded=loaded, threads=threads, **options)
    built = time.perf_counter() - t0
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, logprobs=0)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    took = time.perf_counter() - t0
    return {
        "tokens": [o.outputs[0].token_ids for o in outs],
        "first_logprobs": [o.outputs[0].logprobs[0].logprob for o in outs],
        "build_s": built,
        "generate_s": took,
        "kv_bytes_per_token": llm.engine.kv_bytes_per_token,
        "kernels": llm.engine.kernels(),
    }


def parted(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (None: they do not)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def impossible(model: str, loaded, threads: int) -> dict:
    """Each ask the stack cannot honour: refused or not, how fast, the message, the work."""
    spec = loaded.spec
    asks = {
        "context_past_the_model": {"max_model_len": spec.max_position * 2},
        "unknown_kv_cache_type": {"kv_cache_dtype": "fp4"},
        "tensor_parallel_splitting_no_head": {"tensor_parallel_size": 4},
        "more_stages_than_layers": {"pipeline_parallel_size": spec.n_layers + 1},
        "absent_gpu": {"device": "cuda:7"},
    }
    out = {}
    for name, options in asks.items():
        t0 = time.perf_counter()
        try:
            LLM(model, loaded=loaded, threads=threads, warmup=False, **options)
            out[name] = {"refused": False, "seconds": time.perf_counter() - t0}
        except (ValueError, RuntimeError) as e:
            out[name] = {"refused": True, "seconds": time.perf_counter() - t0,
                         "error": type(e).__name__, "message": str(e)}  # fmt: skip
    llm = LLM(model, loaded=loaded, threads=threads, warmup=False)
    engine, loop = llm.engine, llm.loop
    requests = {
        "prompt_past_the_context": ([5] * (engine.max_model_len + 1), 4),
        "token_outside_the_vocabulary": ([spec.vocab_size + 5], 4),
        "empty_prompt": ([], 4),
    }
    for name, (ids, max_tokens) in requests.items():
        steps = len(engine.stats)
        t0 = time.perf_counter()
        try:
            loop.add_request(ids, params=SamplingParams(max_tokens=max_tokens))
            out[name] = {"refused": False, "seconds": time.perf_counter() - t0}
        except ValueError as e:
            out[name] = {"refused": True, "seconds": time.perf_counter() - t0,
                         "error": type(e).__name__, "message": str(e)}  # fmt: skip
        out[name]["steps_run"] = len(engine.stats) - steps
        out[name]["queued"] = engine.has_unfinished()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("--tokens", type=int, default=24, help="greedy tokens a prompt")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results")
    args = parse_lab_args(ap, fast=dict(prompts=2, prompt_tokens=24, tokens=4))
    torch.set_num_threads(args.threads)
    loaded = load(args.model)
    ids = LLM(args.model, loaded=loaded, warmup=False).tokenizer.encode(TEXT.read_text())
    step = len(ids) // args.prompts
    prompts = [ids[i * step : i * step + args.prompt_tokens] for i in range(args.prompts)]

    base = run(args.model, loaded, {}, prompts, args.tokens, args.threads)
    print(f"baseline: {base['generate_s']:.2f} s, {base['kernels']}")
    changes = {}
    for name, (kind, options, spec_change) in tqdm(CHANGES.items(), desc="changes", unit="change"):
        source = loaded
        if spec_change:
            spec = dataclasses.replace(loaded.spec, **spec_change(loaded.spec))
            source = dataclasses.replace(loaded, spec=spec)
        r = run(args.model, source, options, prompts, args.tokens, args.threads)
        parts = [parted(a, b) for a, b in zip(base["tokens"], r["tokens"], strict=True)]
        r |= {
            "kind": kind,
            "options": options,
            "spec": spec_change(loaded.spec) if spec_change else {},
            "same_tokens": sum(p is None for p in parts),
            "first_parted": min((p for p in parts if p is not None), default=None),
            "first_logprob_shift": max(
                abs(a - b) for a, b in zip(base["first_logprobs"], r["first_logprobs"], strict=True)
            ),
            "time_ratio": r["generate_s"] / base["generate_s"],
        }
        changes[name] = r
        print(f"{name:28s} {kind:8s} {r['same_tokens']}/{len(prompts)} same, first logprob "
              f"moved {r['first_logprob_shift']:.1e}, {r['time_ratio']:.2f}x the time")  # fmt: skip
    refusals = impossible(args.model, loaded, args.threads)
    for name, r in refusals.items():
        said = r.get("message", "accepted")
        print(f"{name}: {'refused' if r['refused'] else 'ACCEPTED'} in "
              f"{r['seconds'] * 1e3:.2f} ms: {said[:100]}")  # fmt: skip

    record = make_record(
        kind="lab.one_change",
        engine={"threads": args.threads, "baseline": "defaults"},
        model={"id": args.model},
        workload={
            "prompts": args.prompts,
            "prompt_tokens": args.prompt_tokens,
            "tokens": args.tokens,
            "text": "docs/architecture.md",
            "greedy": True,
        },  # fmt: skip
        results={
            "baseline": {k: v for k, v in base.items() if k != "tokens"},
            "changes": {
                k: {f: v for f, v in r.items() if f != "tokens"} for k, r in changes.items()
            },
            "asked_the_impossible": refusals,
        },  # fmt: skip
        seeds=[0],
    )
    path = write_record(record, args.out)

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    names = list(changes)  # snake_case: record keys carry no spaces
    colours = {"schedule": "#4477aa", "arithmetic": "#ccbb44", "model": "#ee6677"}
    ys = range(len(names))
    a.barh(ys, [changes[n]["same_tokens"] / len(prompts) for n in names],
           color=[colours[changes[n]["kind"]] for n in names])  # fmt: skip
    a.set(yticks=list(ys), yticklabels=[n.replace("_", " ") for n in names],
          xlabel="share of prompts with the baseline's tokens",
          title="tokens kept (blue: schedule, yellow: arithmetic, red: model)")  # fmt: skip
    a.invert_yaxis()
    b.barh(ys, [changes[n]["time_ratio"] for n in names],
           color=[colours[changes[n]["kind"]] for n in names])  # fmt: skip
    b.axvline(1, color="k", lw=0.8)
    b.set(xlabel="time / baseline's", title="time")
    fig.tight_layout()
    save_figure(fig, args.out, path.with_suffix(".png").name)
    print(f"record: {path}")


if __name__ == "__main__":
    main()
