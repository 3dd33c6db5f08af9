"""`tokenworks bench lora`: what serving LoRA adapters costs. One batch of B sequences
decodes with no adapter, then with 1, 4 and 16 adapters mixed among its rows, on one engine
with adapters enabled, in turn for --repeats rounds (the best of each kept); and on the
default engine, without them. The adapters are random, of the given rank, on every attention and MLP
product, written as PEFT writes them.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from tqdm import tqdm

from tokenworks.bench.batches import measure
from tokenworks.bench.record import make_record, model_record, write_record
from tokenworks.config import engine_kwargs

TARGETS = {  # PEFT's module -> (input size, output size) of the model's spec
    "q_proj": ("hidden_size", "q_size"),
    "k_proj": ("hidden_size", "kv_size"),
    "v_proj": ("hidden_size", "kv_size"),
    "o_proj": ("q_size", "hidden_size"),
    "gate_proj": ("hidden_size", "intermediate_size"),
    "up_proj": ("hidden_size", "intermediate_size"),
    "down_proj": ("intermediate_size", "hidden_size"),
}


def write_adapter(path: Path, spec, rank: int, seed: int) -> None:
    """A random PEFT adapter for this model's shape."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(spec.n_layers):
        for module, (n_in, n_out) in TARGETS.items():
            group = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{group}.{module}"
            a = torch.randn(rank, getattr(spec, n_in), generator=g) * 0.01
            b = torch.randn(getattr(spec, n_out), rank, generator=g) * 0.01
            tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = a, b
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}
    (path / "adapter_config.json").write_text(json.dumps(config))


def run_lora(args) -> Path:
    from tokenworks import LLM
    from tokenworks.bench.workload import latency_prompt

    threads = args.threads or 2
    mixes = sorted(set(args.mixes))
    base_kw = {**engine_kwargs(args), "threads": threads, "enable_prefix_caching": False,
               "max_num_seqs": args.batch, "warmup": False}  # fmt: skip
    base_kw["max_model_len"] = base_kw.get("max_model_len") or (
        args.prompt_tokens + args.decode_tokens + 16)  # fmt: skip
    torch.set_num_threads(threads)
    plain = LLM(args.model, **base_kw)
    spec = plain.engine.spec
    pool = latency_prompt(args.prompt_tokens * args.batch, spec.vocab_size)
    prompts = [pool[i * args.prompt_tokens : (i + 1) * args.prompt_tokens]
               for i in range(args.batch)]  # fmt: skip
    plain_runs = [measure(plain.engine, prompts, args.decode_tokens) for _ in range(args.repeats)]
    results = {"default_engine_no_lora": max(plain_runs, key=lambda r: r["decode_tok_s"] or 0)}
    loaded = plain.engine.loaded
    del plain
    llm = LLM(args.model, **(base_kw | {"enable_lora": True, "max_loras": max(mixes),
                                        "max_lora_rank": args.rank}))  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(max(mixes)):
            write_adapter(Path(tmp) / f"a{k}", spec, args.rank, seed=k)
            llm.engine.lora.load(f"a{k}", str(Path(tmp) / f"a{k}"))
    # the base and each mix in turn, round after round, the best of each kept: a shared
    # machine's slow minutes then fall on every configuration alike
    runs = {"base": None} | {f"adapters_{mix}": mix for mix in mixes}
    for _ in tqdm(range(args.repeats), desc="rounds", unit="round"):
        for name, mix in runs.items():
            loras = [f"a{i % mix}" for i in range(args.batch)] if mix else None
            got = measure(llm.engine, prompts, args.decode_tokens, loras)
            best = results.get(name)
            if best is None or (got["decode_tok_s"] or 0) > (best["decode_tok_s"] or 0):
                results[name] = got
    base = results["base"]["decode_tok_s"]
    ratios = {f"adapters_{m}": results[f"adapters_{m}"]["decode_tok_s"] / base for m in mixes}
    ratios["default_engine_no_lora"] = results["default_engine_no_lora"]["decode_tok_s"] / base
    record = make_record(
        kind="lora",
        engine=llm.config.to_dict(),
        model=model_record(llm),
        workload={
            "batch": args.batch,
            "mixes": mixes,
            "rank": args.rank,
            "prompt_tokens": args.prompt_tokens,
            "decode_tokens": args.decode_tokens,
            "repeats": args.repeats,
            "threads": threads,
            "targets": list(TARGETS),
            "adapters": "random A and B (normal * 0.01), every layer, PEFT's format",
            "sampling": "greedy, EOS ignored",
        },  # fmt: skip
        results={
            "tokenworks": results,
            "decode_ratio_to_base": ratios,
            "file": str(loaded.file_path),
        },  # fmt: skip
        seeds=list(range(max(mixes))),
    )
    path = write_record(record, args.out)
    for name, r in results.items():
        print(f"{name:>24}: decode {r['decode_tok_s'] or 0:8.1f} tok/s, prefill "
              f"{r['prefill_tok_s'] or 0:8.1f} tok/s")  # fmt: skip
    print(f"record: {path}")
    return path
