"""`tokenworks bench throughput`: offline throughput of many requests, with peers, one record.

The workload of the batching issue: N requests of distinct P-token prompts, O output
tokens each, greedy, EOS ignored, all submitted at once. Our engine runs them through
continuous batching (LLM.generate); peers run the same token ids in their own venvs in the
same run. The record also says how much KV memory the paged pool actually used at its
peak against what a contiguous cache (one max-length row per sequence) would reserve.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from tokenworks.bench.latency import parse_peers, run_peer
from tokenworks.bench.record import make_record, model_record, write_record
from tokenworks.bench.workload import latency_prompt
from tokenworks.config import engine_kwargs

PEER_SCRIPTS = {
    "transformers": "transformers_throughput.py",
    "llama.cpp": "llamacpp_throughput.py",
    "vllm": "vllm_throughput.py",
}


def distinct_prompts(n: int, length: int, vocab_size: int) -> list[list[int]]:
    return [latency_prompt(length, vocab_size, seed=1000 + i) for i in range(n)]


def run_throughput(args) -> Path:
    from tokenworks import LLM, SamplingParams

    peers = parse_peers(args.peer, PEER_SCRIPTS)
    threads = args.threads or 2
    llm = LLM(args.model, **{**engine_kwargs(args), "threads": threads})
    engine = llm.engine
    prompts = distinct_prompts(args.num_prompts, args.input_tokens, engine.spec.vocab_size)
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    engine.blocks.reset_prefix_cache()  # the measured prompts must not hit the warm-up's
    engine.stats.clear()
    t = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    stats = list(engine.stats)
    block_bytes = engine.kv_bytes_per_token * engine.config.block_size
    peak_blocks = max(round(s.kv_usage * engine.blocks.num_blocks) for s in stats)
    per_seq = args.input_tokens + args.output_tokens
    kv = {
        "paged_peak_bytes": peak_blocks * block_bytes,
        "paged_pool_bytes": engine.blocks.num_blocks * block_bytes,
        "contiguous_max_model_len_bytes": args.num_prompts
        * engine.max_model_len
        * engine.kv_bytes_per_token,
        "contiguous_exact_length_bytes": args.num_prompts * per_seq * engine.kv_bytes_per_token,
        "bytes_per_token": engine.kv_bytes_per_token,
    }
    ours = {
        "elapsed_s": elapsed,
        "output_tokens": generated,
        "output_tok_s": generated / elapsed,
        "total_tok_s": (generated + args.num_prompts * args.input_tokens) / elapsed,
        "steps": len(stats),
        "max_batch_size": max(s.batch_size for s in stats),
        "preemptions": sum(s.preemptions for s in stats),
    }
    peer_args = {
        "gguf": engine.loaded.file_path,
        "hf_dir": os.environ.get("TOKENWORKS_PEER_HF_DIR", ""),
        "prompts": prompts,
        "output_tokens": args.output_tokens,
        "threads": threads,
        "dtype": llm.config.resolved_dtype,
    }
    peer_results = {}
    for name, python in peers.items():
        print(f"measuring peer {name} with {python}")
        env_script = PEER_SCRIPTS[name]
        peer_results[name] = run_peer(name, python, peer_args, script=env_script)
    ratios = {
        name: ours["output_tok_s"] / r["output_tok_s"]
        for name, r in peer_results.items()
        if r.get("status") == "OK"
    }
    record = make_record(
        kind="throughput",
        engine=llm.config.to_dict(),
        model=model_record(llm),
        workload={
            "num_prompts": args.num_prompts,
            "input_tokens": args.input_tokens,
            "output_tokens": args.output_tokens,
            "threads": threads,
            "prompt_seeds": [1000 + i for i in range(args.num_prompts)],
            "eos": "ignored",
            "sampling": "greedy",
            "arrival": "all at once (offline)",
        },
        results={
            "tokenworks": ours,
            "kv_memory": kv,
            "ratio_tokenworks_to_peer_output_tok_s": ratios,
            "steps": [s.__dict__ for s in stats],
        },
        seeds=[1000],
        peers=peer_results,
    )
    path = write_record(record, args.out)
    print(json.dumps({"tokenworks": ours, "kv_memory": kv, "ratios": ratios}, indent=2))
    print(f"record: {path}")
    return path
