"""Eager, compiled and C-kernel step times: decode at several batch sizes and a prompt pass.

For each model and mode (eager: the torch modules; compiled: the same under --compile;
c: the C kernels' forward) in one dtype, with the weights dequantised alike
(--quantization none), it times one prompt pass of --prompt tokens and one decode step of
each batch (every sequence at --context tokens), the median of --repeats, and for the
compiled mode the graphs built and the seconds spent building them. Where each mode wins
is the point: per-op dispatch at small batches, fusion of the elementwise work, and the
products' bandwidth and FLOP rate at large ones.
"""

from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from tokenworks.bench.record import make_record, write_record
from tokenworks.config import EngineConfig
from tokenworks.engine.engine import LLMEngine
from tokenworks.engine.loop import EngineLoop
from tokenworks.engine.request import SamplingParams

MODES = {"eager": {"kernels": "torch"}, "compiled": {"kernels": "torch", "compile": True},
         "c": {"kernels": "c"}}  # fmt: skip


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed_step(loop: EngineLoop) -> float:
    device = loop.engine.config.device
    _sync(device)
    t = time.perf_counter()
    loop.step()
    _sync(device)
    return time.perf_counter() - t


def prompt_of(n: int, vocab: int, seed: int) -> list[int]:
    return [(seed * 7919 + 31 * i) % (vocab - 2) + 1 for i in range(n)]


def measure_mode(loaded, config: EngineConfig, prompt: int, context: int, batches, repeats):
    """{"prefill_s", "decode_s": {batch: s}, "compile": CompileStats dict or None}."""
    engine = LLMEngine(config, loaded)
    loop = EngineLoop(engine)
    vocab = engine.spec.vocab_size
    once = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    times = []
    for r in range(repeats + 1):  # the first builds buffers (and graphs): untimed
        loop.add_request(prompt_of(prompt, vocab, r), once)
        t = timed_step(loop)
        loop.run_while(engine.has_unfinished)
        times.append(t)
    out = {"prefill_s": statistics.median(times[1:]), "decode_s": {}}
    long = SamplingParams(max_tokens=1 << 20, temperature=0, ignore_eos=True)
    for batch in batches:
        seqs = [loop.add_request(prompt_of(context, vocab, 100 + i), long) for i in range(batch)]
        loop.run_while(lambda seqs=seqs: any(s.n_cached < context for s in seqs))
        loop.step()  # the first step of this batch size (a graph for it, where compiled)
        out["decode_s"][batch] = statistics.median([timed_step(loop) for _ in range(repeats)])
        for s in seqs:
            loop.abort(s.request_id)
    stats = engine.compile_stats
    out["compile"] = stats.to_dict() if stats is not None else None
    return out


def run_compiled_bench(args) -> Path:
    from tokenworks.models import load

    torch.set_num_threads(args.threads or torch.get_num_threads())
    # a cold compile, what a first start pays: Inductor's caches (graphs, generated code)
    # start empty for each graph
    torch.compiler.config.force_disable_caches = True
    batches = list(args.batches)
    modes = list(args.modes)
    rows = {}
    base = dict(dtype=args.dtype, device=args.device, quantization="none", warmup=False,
                enable_prefix_caching=False, max_num_seqs=max(batches),
                max_num_batched_tokens=max(args.prompt, max(batches)))  # fmt: skip
    for name in args.models:
        loaded = load(name)
        for mode in tqdm(modes, desc=name):
            if mode == "c" and args.device != "cpu":
                continue
            config = EngineConfig(model=name, **base, **MODES[mode])
            rows.setdefault(name, {})[mode] = measure_mode(
                loaded, config, args.prompt, args.context, batches, args.repeats
            )
            gc.collect()
        del loaded
        gc.collect()
    record = make_record(
        kind="compiled",
        engine=base | {"modes": {m: MODES[m] for m in modes}, "threads": torch.get_num_threads()},
        model={"names": list(args.models)},
        workload={
            "prompt": args.prompt,
            "context": args.context,
            "batches": batches,
            "repeats": args.repeats,
            "sampling": "greedy",
            "inductor_caches": "disabled (cold compiles)",
        },
        results={"rows": rows},
    )
    path = write_record(record, args.out)
    print(table(rows, batches))
    print(f"record: {path}")
    return path


def table(rows: dict, batches) -> str:
    head = " | ".join(f"decode {b} ms" for b in batches)
    out = [f"| model / mode | prompt ms | {head} | graphs | compile s |",
           "|---|---|" + "---|" * len(batches) + "---|---|"]  # fmt: skip
    for name, modes in rows.items():
        for mode, r in modes.items():
            dec = " | ".join(f"{r['decode_s'][b] * 1e3:.1f}" for b in batches)
            c = r["compile"] or {}
            out.append(f"| {name} {mode} | {r['prefill_s'] * 1e3:.1f} | {dec} | "
                       f"{c.get('graphs', '')} | {c.get('seconds', 0):.1f} |")  # fmt: skip
    return "\n".join(out)
