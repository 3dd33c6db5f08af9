"""`tokenworks bench quant`: the four things called quantisation quality, measured apart.

For each model and each format it runs in (float32 and bfloat16 on the dequantised
weights, int8 rows and int4 groups re-quantised from them, and the GGUF file's own blocks
as executed), one record holds:

- storage: the file's bytes, the bytes the built model holds for its weights (a mapped
  block counted once), and those a decode step reads (one row of an embedding table that
  is not also the LM head);
- reconstruction: per weight matrix, the relative Frobenius and the largest error of what
  the format multiplies by, against the file's dequantised float32 weights (the file's own
  blocks are that reference, error 0: their error against the model before it was
  quantised is not in the file);
- behaviour: perplexity on held-out text (eval/perplexity.py), and against float32 on a
  prompt set, how many greedy tokens agree from the start and the share of positions
  whose top-1 token agrees (teacher-forced on float32's continuation);
- speed: batch-1 decode and a 512-token prefill, with llama.cpp's `llama-bench` on the
  same file in the same run, and (for the formats in --offline-formats) offline throughput.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import torch
from tqdm import tqdm

from tokenworks.bench.ceilings import decode_bytes, weight_bytes
from tokenworks.bench.record import make_record, write_record

FORMATS = {  # name -> (dtype, quantization)
    "float32": ("float32", "none"),
    "bfloat16": ("bfloat16", "none"),
    "int8": ("bfloat16", "int8"),
    "int4": ("bfloat16", "int4"),
    "gguf": ("bfloat16", "gguf"),
}
PROMPTS = [
    "The history of the printing press begins",
    "def fibonacci(n):\n    ",
    "Write a short poem about the sea.",
    "The three largest planets in the solar system are",
    "In a small village at the edge of the forest, there lived",
    "To make bread, you first need to",
    "Question: What is the capital of Australia?\nAnswer:",
    "import numpy as np\n\ndef normalise(x):\n",
]


def multiplied_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What each product of the model multiplies by, as float32 [out, in]."""
    from tokenworks.kernels.block_linear import BlockLinear
    from tokenworks.ops.linear import (
        DenseForLargeBatches,
        Int4Linear,
        Int8Linear,
        MatvecLinear,
        int4_dequantize,
    )

    out = {}
    for name, m in model.named_modules():
        if isinstance(m, DenseForLargeBatches):
            m = m.quantized
        if isinstance(m, BlockLinear):
            out[name] = m.dequantized(torch.float32)
        elif isinstance(m, Int8Linear):
            out[name] = m.qweight.float() * m.scale.float()[:, None]
        elif isinstance(m, Int4Linear):
            sz = m.scales_and_zeros.float()
            out[name] = int4_dequantize(_int4_values(m), sz)
        elif isinstance(m, (torch.nn.Linear, MatvecLinear)):
            out[name] = m.weight.detach().float()
    return out


def _int4_values(m) -> torch.Tensor:
    """An Int4Linear's 4-bit values [N, K] (from its Q4 blocks, the same grid)."""
    from tokenworks.ops.linear import INT4_GROUP

    b = m.q4_blocks.reshape(m.out_features, m.in_features // INT4_GROUP, 20)
    lo, hi = (b[..., 4:] & 0xF).long(), (b[..., 4:] >> 4).long()
    return torch.cat([lo, hi], dim=-1).reshape(m.out_features, m.in_features)


def reconstruction(ref: dict, got: dict) -> dict:
    rows = {}
    for name, w in ref.items():
        if name not in got:
            continue
        err = got[name] - w
        rows[name] = {
            "rel_frobenius": float(err.norm() / w.norm().clamp(min=1e-30)),
            "rel_max": float(err.abs().max() / w.abs().max().clamp(min=1e-30)),
        }
    fro = [r["rel_frobenius"] for r in rows.values()]
    return {
        "tensors": len(rows),
        "rel_frobenius_mean": sum(fro) / max(len(fro), 1),
        "rel_frobenius_max": max(fro, default=0.0),
        "rel_max_max": max((r["rel_max"] for r in rows.values()), default=0.0),
    }


def greedy(llm, prompts: list[list[int]], n: int) -> list[list[int]]:
    from tokenworks import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def top1(llm, seqs: list[list[int]], starts: list[int]) -> list[list[int]]:
    """Each sequence's argmax at every position from its start on, in one uncached pass."""
    out = []
    for ids, start in zip(seqs, starts, strict=True):
        logits = llm.engine.runner.run_uncached(ids)
        out.append(logits[start - 1 : len(ids) - 1].argmax(-1).tolist())
    return out


def agreement(ref: list[list[int]], got: list[list[int]]) -> float:
    same = sum(a == b for r, g in zip(ref, got, strict=True) for a, b in zip(r, g, strict=True))
    return same / max(sum(len(r) for r in ref), 1)


def leading(ref: list[int], got: list[int]) -> int:
    n = 0
    for a, b in zip(ref, got, strict=False):
        if a != b:
            break
        n += 1
    return n


def llama_bench(bin_dir: Path, path: str, threads: int, prompt: int, decode: int) -> dict:
    exe = bin_dir / "llama-bench"
    if not exe.exists():
        return {"status": "NOT_RUN", "reason": f"no {exe} (benchmarks/peers.sh builds it)"}
    argv = [str(exe), "-m", path, "-t", str(threads), "-p", str(prompt), "-n", str(decode),
            "-r", "3", "-o", "json"]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        return {"status": "FAILED", "stderr_tail": proc.stderr[-2000:]}
    rows = json.loads(proc.stdout[proc.stdout.index("[") :])
    out = {"status": "OK"}
    for r in rows:
        key = "prefill_tok_s" if r["n_prompt"] else "decode_tok_s"
        out[key] = r["avg_ts"]
        out[key + "_samples"] = r["samples_ts"]
    return out


def run_model(model: str, args, text_ids_for, ceilings: dict) -> dict:
    from collections import Counter

    from tokenworks import LLM
    from tokenworks.bench.ceilings import shares
    from tokenworks.bench.latency import measure_tokenworks, summarise
    from tokenworks.bench.workload import latency_prompt
    from tokenworks.eval.perplexity import perplexity
    from tokenworks.kernels.blocks import type_name
    from tokenworks.models import load

    loaded = load(model)
    threads = args.threads or 2
    results: dict = {"file": loaded.file_path, "file_bytes": Path(loaded.file_path).stat().st_size}
    if loaded.gguf_index is not None:  # which block types the file holds, tensors of each
        types = Counter(type_name(t.ggml_type) for t in loaded.gguf_index.tensors)
        results["tensor_types"] = dict(sorted(types.items()))
    ref_weights = ref_greedy = ref_top1 = None
    formats = list(args.formats)
    for fmt in tqdm(formats, desc=model, unit="format"):
        dtype, quantization = FORMATS[fmt]
        llm = LLM(model, loaded=loaded, dtype=dtype, quantization=quantization, threads=threads,
                  enable_prefix_caching=False, warmup=False)  # fmt: skip
        tok, engine = llm.tokenizer, llm.engine
        row: dict = {"dtype": dtype, "quantization": engine.quantization or "none",
                     "kernels": engine.kernels()}  # fmt: skip
        row["storage"] = {
            "weight_bytes": weight_bytes(engine.model),
            "decode_bytes": decode_bytes(engine.model),
        }
        row["reconstruction"] = None
        if fmt == "float32" or ref_weights is not None:  # (a float32 copy of every product)
            weights = multiplied_weights(engine.model)
            if fmt == "float32":
                ref_weights = weights
            row["reconstruction"] = reconstruction(ref_weights, weights)
            del weights
        ids = text_ids_for(tok)
        row["perplexity"] = perplexity(engine, ids, args.ppl_context, args.ppl_context // 2)
        prompts = [tok.encode(p) for p in PROMPTS]
        outs = greedy(llm, prompts, args.greedy_tokens)
        if fmt == "float32":
            ref_greedy = outs
            ref_top1 = top1(llm, [p + o for p, o in zip(prompts, outs, strict=True)],
                            [len(p) for p in prompts])  # fmt: skip
        if ref_greedy is not None:
            mine = top1(llm, [p + o for p, o in zip(prompts, ref_greedy, strict=True)],
                        [len(p) for p in prompts])  # fmt: skip
            row["behaviour"] = {
                "greedy_leading_agreement": [leading(r, o) for r, o in zip(ref_greedy, outs,
                                                                          strict=True)],
                "greedy_tokens": args.greedy_tokens,
                "top1_agreement": agreement(ref_top1, mine),
            }  # fmt: skip
        prompt = latency_prompt(args.prompt_tokens, engine.spec.vocab_size)
        speed = measure_tokenworks(llm, prompt, prompt[:16], args.decode_tokens, args.repeats)
        row["speed"] = {k + "_samples": v for k, v in speed.items()} | summarise(speed)
        row["speed"] |= shares(engine, row["speed"].get("decode_tok_s"),
                               row["speed"].get("prefill_tok_s"), ceilings)  # fmt: skip
        results[fmt] = row
        del llm, engine
    results["llama.cpp"] = llama_bench(Path(args.peers_dir) / "llamacpp" / "bin",
                                       loaded.file_path, threads, args.prompt_tokens,
                                       args.decode_tokens)  # fmt: skip
    lc = results["llama.cpp"]
    if lc.get("status") == "OK":
        for fmt in formats:
            s = results[fmt]["speed"]
            s["ratio_to_llama_cpp"] = {
                k: s[k] / lc[k] for k in ("decode_tok_s", "prefill_tok_s") if k in s and lc.get(k)
            }
    return results


def run_quant(args) -> Path:
    from tokenworks.bench.long_context import english_text

    text = english_text(args.text)
    text_name = args.text or "music21 languageExcerpts/trainingData/en.txt (Lady Susan)"

    def text_ids_for(tok):
        return tok.encode(text)[: args.ppl_tokens]

    import torch

    from tokenworks.bench.ceilings import machine_ceilings

    models = list(args.models)
    torch.set_num_threads(args.threads or 2)
    ceilings = machine_ceilings()  # what decode and prefill can take at best, in this run
    # a file's results under its stem, so a record's keys hold no path separators
    results = {Path(m).stem if m.endswith(".gguf") else m:
               run_model(m, args, text_ids_for, ceilings) for m in models}  # fmt: skip
    record = make_record(
        kind="quantisation",
        engine={
            "threads": args.threads or 2,
            "formats": {f: FORMATS[f] for f in args.formats},
            **ceilings,
        },
        model={"models": models},
        workload={
            "text": text_name,
            "ppl_tokens": args.ppl_tokens,
            "ppl_context": args.ppl_context,
            "ppl_stride": args.ppl_context // 2,
            "prompts": PROMPTS,
            "greedy_tokens": args.greedy_tokens,
            "prompt_tokens": args.prompt_tokens,
            "decode_tokens": args.decode_tokens,
            "repeats": args.repeats,
        },  # fmt: skip
        results=results,
        seeds=[0],
    )
    path = write_record(record, args.out)
    plot(record, path.with_suffix(".png"))
    for m, r in results.items():
        print(m)
        for fmt in args.formats:
            row = r[fmt]
            s = row["speed"]
            print(f"  {fmt:9s} ppl {row['perplexity']['perplexity']:8.3f}  decode "
                  f"{s['decode_tok_s']:6.1f}  prefill {s['prefill_tok_s']:7.1f}  "
                  f"x llama.cpp {s.get('ratio_to_llama_cpp', {})}  of the read "
                  f"{s.get('bandwidth_share', 0):.0%}, of the {s.get('peak_kind', '-')} peak "
                  f"{s.get('peak_share', 0):.0%}")  # fmt: skip
    print(f"record: {path}")
    return path


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = record["results"]
    models = list(results)
    formats = list(record["engine"]["formats"])
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    width = 0.8 / (len(formats) + 1)
    for i, fmt in enumerate(formats):
        xs = [j + i * width for j in range(len(models))]
        axes[0].bar(xs, [results[m][fmt]["speed"]["decode_tok_s"] for m in models], width,
                    label=fmt)  # fmt: skip
        axes[1].bar(xs, [results[m][fmt]["storage"]["weight_bytes"] / 2**20 for m in models],
                    width, label=fmt)  # fmt: skip
        ref = [results[m]["float32"]["perplexity"]["perplexity"] if "float32" in results[m]
               else math.nan for m in models]  # fmt: skip
        axes[2].bar(xs, [results[m][fmt]["perplexity"]["perplexity"] / r - 1 for m, r in
                         zip(models, ref, strict=True)], width, label=fmt)  # fmt: skip
    lc = [results[m]["llama.cpp"].get("decode_tok_s", math.nan) for m in models]
    axes[0].bar([j + len(formats) * width for j in range(len(models))], lc, width,
                label="llama.cpp (file)", color="black")  # fmt: skip
    for ax, title in zip(axes, ("batch-1 decode, tok/s", "weights held, MiB",
                                "perplexity / float32's - 1"), strict=True):  # fmt: skip
        ax.set_xticks([j + 0.4 for j in range(len(models))], models, rotation=15, fontsize=8)
        ax.set_title(title)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
