"""`tokenworks bench batches`: tokens a second against the number of sequences running
together, tokenworks beside llama.cpp's `llama-batched-bench` on the same file.

For each batch size B, B different prompts of the same length are prefilled and then
decode together. Prefill is the prompt tokens over the seconds of the steps that held
prompt tokens; decode is the tokens over the seconds of the steps that decoded all B
sequences and nothing else (the engine's own step records). llama-batched-bench does the
same with B sequences of its own (`-npp`, `-ntg`, `-npl`; S_PP and S_TG). Both engines run
with the same threads, one after the other, in the same run; the figures are plotted
against B on a log scale.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tqdm import tqdm

from tokenworks.bench.record import make_record, model_record, write_record
from tokenworks.config import engine_kwargs
from tokenworks.engine.loop import EngineLoop


def measure(engine, prompts: list[list[int]], steps: int, loras=None) -> dict:
    """Prefill and decode tok/s of the prompts run together for `steps` decode steps
    (loras: each prompt's LoRA adapter, None for the base model)."""
    from tokenworks import SamplingParams

    params = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    engine.stats.clear()
    loop = EngineLoop(engine)
    for p, lora in zip(prompts, loras or [None] * len(prompts), strict=True):
        loop.add_request(p, params, lora=lora)
    loop.run_while(engine.has_unfinished)
    stats = list(engine.stats)
    pre = [s for s in stats if s.prefill_tokens]
    dec = [s for s in stats if not s.prefill_tokens and s.decode_tokens == len(prompts)]
    pre_s, dec_s = sum(s.duration_s for s in pre), sum(s.duration_s for s in dec)
    return {
        "prefill_tok_s": sum(s.prefill_tokens for s in pre) / pre_s if pre_s else None,
        "decode_tok_s": sum(s.decode_tokens for s in dec) / dec_s if dec_s else None,
        "prefill_steps": len(pre),
        "decode_steps": len(dec),
    }


def batched_bench(bin_dir: Path, path: str, threads: int, batches: list[int], prompt: int,
                  decode: int) -> dict:  # fmt: skip
    """llama-batched-bench's S_PP and S_TG for each batch size, by B."""
    exe = bin_dir / "llama-batched-bench"
    if not exe.exists():
        return {"status": "NOT_RUN", "reason": f"no {exe} (benchmarks/peers.sh builds it)"}
    argv = [str(exe), "-m", path, "-t", str(threads), "-c", str(max(batches) * (prompt + decode)),
            "-b", "2048", "-ub", "512", "-npp", str(prompt), "-ntg", str(decode),
            "-npl", ",".join(map(str, batches)), "--output-format", "jsonl"]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        return {"status": "FAILED", "stderr_tail": proc.stderr[-2000:]}
    out: dict = {"status": "OK", "argv": argv[1:]}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            out[str(r["pl"])] = {"prefill_tok_s": r["speed_pp"], "decode_tok_s": r["speed_tg"]}
    return out


def run_batches(args) -> Path:
    import torch

    from tokenworks import LLM
    from tokenworks.bench.workload import latency_prompt

    threads = args.threads or 2
    batches = list(args.batches)
    kwargs = {**engine_kwargs(args), "threads": threads, "enable_prefix_caching": False}
    # room for the largest batch's full sequences (the KV pool is sized from these two)
    kwargs["max_num_seqs"] = max(batches)
    longest = args.prompt_tokens + args.decode_tokens + 16
    kwargs["max_model_len"] = kwargs.get("max_model_len") or longest
    llm = LLM(args.model, **kwargs)
    torch.set_num_threads(threads)
    vocab = llm.engine.spec.vocab_size
    # B different prompts: one long random prompt cut into pieces
    pool = latency_prompt(args.prompt_tokens * max(batches), vocab)
    ours = {}
    for b in tqdm(batches, desc="tokenworks", unit="batch"):
        prompts = [pool[i * args.prompt_tokens : (i + 1) * args.prompt_tokens] for i in range(b)]
        ours[str(b)] = measure(llm.engine, prompts, args.decode_tokens)
    peer = batched_bench(Path(args.peers_dir) / "llamacpp" / "bin", llm.engine.loaded.file_path,
                         threads, batches, args.prompt_tokens, args.decode_tokens)  # fmt: skip
    ratios = {}
    if peer["status"] == "OK":
        for b in map(str, batches):
            ratios[b] = {k: ours[b][k] / peer[b][k] for k in ("prefill_tok_s", "decode_tok_s")
                         if ours[b].get(k) and peer.get(b, {}).get(k)}  # fmt: skip
    record = make_record(
        kind="batches",
        engine=llm.config.to_dict(),
        model=model_record(llm),
        workload={
            "batches": batches,
            "prompt_tokens": args.prompt_tokens,
            "decode_tokens": args.decode_tokens,
            "threads": threads,
            "prompts": "pieces of one random prompt (workload.latency_prompt), one a sequence",
            "sampling": "greedy, EOS ignored",
        },
        results={"tokenworks": ours, "llama.cpp": peer, "ratio_tokenworks_to_llama_cpp": ratios},
        seeds=[0],
        peers={"llama.cpp": {"status": peer["status"]}},
    )
    path = write_record(record, args.out)
    plot(record, path.with_suffix(".png"))
    for b in map(str, batches):
        o, p = ours[b], peer.get(b, {})
        print(f"B {b:>4}: prefill {o['prefill_tok_s'] or 0:8.1f} / {p.get('prefill_tok_s', 0):8.1f}"
              f"  decode {o['decode_tok_s'] or 0:8.1f} / {p.get('decode_tok_s', 0):8.1f}"
              " (tokenworks / llama.cpp)")  # fmt: skip
    print(f"record: {path}")
    return path


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res, batches = record["results"], record["workload"]["manifest"]["batches"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, title in zip(axes, ("prefill_tok_s", "decode_tok_s"), ("prefill", "decode"),
                              strict=True):  # fmt: skip
        for engine, style in (("tokenworks", "o-"), ("llama.cpp", "s--")):
            got = res[engine]
            ys = [got.get(str(b), {}).get(key) for b in batches]
            if any(ys):
                ax.plot(batches, [y or float("nan") for y in ys], style, label=engine)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequences running together")
        ax.set_ylabel("tok/s")
        ax.set_title(f"{title} ({record['workload']['manifest']['prompt_tokens']}-token prompts)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{record['model']['id']}, {record['workload']['manifest']['threads']} threads")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
