"""Engine speed on a CUDA GPU with random weights in the default model's shape.

The model file cannot travel to a lent GPU machine (no network there, and the tree that
travels is capped), but speed does not depend on the weights' values: a random-weight
model with SmolLM2-135M's exact shape runs the same kernels. Measures single-stream
prefill and decode, offline throughput (N x 128 in / 128 out, EOS ignored), eager
against --compile step times (a 512-token prompt; decode batches 1, 16, 64) and
`tokenworks profile`'s component table, and writes an evidence record naming the GPU.

    python benchmarks/gpu_speed.py --device cuda --out DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from tokenworks.bench.compiled import MODES, measure_mode
from tokenworks.bench.profile import ceiling, profile
from tokenworks.bench.profile import table as profile_table
from tokenworks.bench.record import make_record, write_record
from tokenworks.bench.workload import latency_prompt
from tokenworks.config import EngineConfig
from tokenworks.engine.engine import LLMEngine
from tokenworks.engine.loop import EngineLoop
from tokenworks.engine.request import SamplingParams
from tokenworks.models.loaded import LoadedModel
from tokenworks.models.toy import byte_tokenizer, toy_spec, toy_weights


def smol_shaped() -> LoadedModel:
    spec = dataclasses.replace(
        toy_spec(),
        vocab_size=49152,
        hidden_size=576,
        n_layers=30,
        n_heads=9,
        n_kv_heads=3,
        head_dim=64,
        intermediate_size=1536,
        max_position=8192,
        tie_embeddings=True,
        name="random weights in SmolLM2-135M's shape",
        source="random (seed 0)",
    )
    weights = toy_weights(spec)
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    return LoadedModel(
        spec,
        weights,
        {"kind": "object", "tokenizer": byte_tokenizer()},
        None,
        "random-smollm2-shape",
        None,
        "builtin:random",
    )


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_all(loop: EngineLoop, prompts, n_out: int, device: str) -> float:
    params = SamplingParams(max_tokens=n_out, temperature=0, ignore_eos=True)
    for p in prompts:
        loop.add_request(p, params)
    sync(device)
    t = time.perf_counter()
    loop.run_while(loop.engine.has_unfinished)
    sync(device)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--batches", default="1,64,256")
    args = ap.parse_args()
    loaded = smol_shaped()
    results = {"device_name": torch.cuda.get_device_name() if args.device != "cpu" else "cpu"}
    for batch in [int(b) for b in args.batches.split(",")]:
        config = EngineConfig(
            model="random",
            dtype=args.dtype,
            device=args.device,
            max_num_seqs=max(batch, 1),
            max_num_batched_tokens=8192,
            kv_cache_memory=4.0,
        )
        engine = LLMEngine(config, loaded)
        loop = EngineLoop(engine)
        prompts = [latency_prompt(128, 49152, seed=1000 + i) for i in range(batch)]
        run_all(loop, prompts[:1], 4, args.device)  # warm up
        elapsed = run_all(loop, prompts, 128, args.device)
        steps = list(engine.stats)[-129:]
        decode = [s.duration_s for s in steps if s.decode_tokens and not s.prefill_tokens]
        results[f"batch_{batch}"] = {
            "elapsed_s": elapsed,
            "output_tok_s": batch * 128 / elapsed,
            "decode_step_ms_median": 1e3 * sorted(decode)[len(decode) // 2] if decode else None,
        }
        print(batch, results[f"batch_{batch}"], flush=True)
        # the same prompt is timed repeatedly: no prefix cache, or a hit would time nothing
        loop = EngineLoop(
            LLMEngine(dataclasses.replace(config, enable_prefix_caching=False), loaded)
        )
        prompt = latency_prompt(512, 49152, seed=7)
        times = []
        for _ in range(4):
            loop.add_request(prompt, SamplingParams(max_tokens=1))
            sync(args.device)
            t = time.perf_counter()
            loop.step()
            sync(args.device)
            times.append(time.perf_counter() - t)
        results["prefill_512_tok_s"] = 512 / sorted(times[1:])[1]
    # eager against --compile, and one profile of each phase, on the same random weights
    base = dict(dtype=args.dtype, device=args.device, warmup=False, enable_prefix_caching=False,
                max_num_seqs=64, max_num_batched_tokens=512, kv_cache_memory=4.0)  # fmt: skip
    for mode in ("eager", "compiled"):
        config = EngineConfig(model="random", **base, **MODES[mode])
        results[f"steps_{mode}"] = measure_mode(loaded, config, 512, 128, [1, 16, 64], 5)
        print(mode, results[f"steps_{mode}"], flush=True)
    loop = EngineLoop(LLMEngine(EngineConfig(model="random", **base, kernels="torch"), loaded))
    hw = ceiling(args.device, None)
    results["profile"] = profile(loop, prompt_tokens=512, batch=16, repeats=5, hw=hw)
    print(profile_table(results["profile"]), flush=True)
    print(results)
    record = make_record(
        kind="gpu_speed",
        engine=config.to_dict(),
        model={"id": loaded.model_id, "shape": dataclasses.asdict(loaded.spec)},
        workload={
            "input_tokens": 128,
            "output_tokens": 128,
            "batches": args.batches,
            "prefill_tokens": 512,
            "eos": "ignored",
            "sampling": "greedy",
        },
        results=results,
        seeds=[0, 7, 1000],
    )
    print(write_record(record, args.out))


if __name__ == "__main__":
    main()
