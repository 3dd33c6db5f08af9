"""`tokenworks bench latency`: single-stream prefill and decode speed, with peers, one record.

Prefill: tokens per second of one forward pass over a P-token prompt (the first token's
compute). Decode: tokens per second of N single-token steps after a short prompt, EOS
ignored. Peers run the same token ids in their own virtual environments, in the same run,
and the record keeps every repeat so ratios can be recomputed.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from pathlib import Path

from tqdm import tqdm

from tokenworks.bench.peer_engines import vllm_env
from tokenworks.bench.record import make_record, model_record, write_record
from tokenworks.bench.workload import latency_prompt
from tokenworks.config import engine_kwargs
from tokenworks.engine.loop import LocalInbox

PEER_SCRIPTS = {
    "llama.cpp": "llamacpp_latency.py",
    "transformers": "transformers_latency.py",
    "vllm": "vllm_latency.py",
}
SHORT_PROMPT_TOKENS = 16


def measure_tokenworks(llm, prompt: list[int], short: list[int], n_decode: int, repeats: int):
    from tokenworks import SamplingParams

    loop = llm.loop
    prefill, decode = [], []
    for i in tqdm(range(repeats + 1), desc="tokenworks"):  # round 0 warms up, dropped
        seq = loop.add_request(prompt, SamplingParams(max_tokens=1, temperature=0))
        t = time.perf_counter()
        loop.step()
        dt = time.perf_counter() - t
        assert seq.finished
        params = SamplingParams(max_tokens=n_decode + 1, temperature=0, ignore_eos=True)
        seq = loop.add_request(short, params)
        loop.step()  # prefill + first token
        t = time.perf_counter()
        loop.run_while(lambda seq=seq: not seq.finished)
        dd = time.perf_counter() - t
        if i:
            prefill.append(len(prompt) / dt)
            decode.append(n_decode / dd)
    return {"prefill_tok_s": prefill, "decode_tok_s": decode}


def prompt_steps(loop, prompt: list[int]) -> list:
    """Run a prompt alone for one new token; the engine's StepStats of that run (one step
    unless the token budget chunked the prompt)."""
    from tokenworks import SamplingParams

    engine = loop.engine
    engine.stats.clear()
    loop.add_request(prompt, SamplingParams(max_tokens=1, temperature=0))
    loop.run_while(engine.has_unfinished)
    return list(engine.stats)


def decode_step_times(loop, prompts: list[list[int]], steps: int) -> list[float]:
    """Durations of `steps` pure decode steps with every one of the prompts' sequences in
    the pass. The prompts are prefilled first, in as many steps as the token budget needs
    (sequences prefilled early decode meanwhile, so they get the tokens to keep going);
    afterwards the sequences are aborted and their blocks freed."""
    from tokenworks import SamplingParams

    engine = loop.engine
    early = -(-sum(map(len, prompts)) // engine.config.max_num_batched_tokens) + 4
    params = SamplingParams(max_tokens=steps + early, temperature=0, ignore_eos=True)
    seqs = [loop.add_request(p, params) for p in prompts]
    engine.stats.clear()
    timed = []
    for _ in loop.turns(LocalInbox(), lambda: len(timed) < steps and engine.has_unfinished()):
        s = engine.stats[-1]
        if s.prefill_tokens == 0 and s.decode_tokens == len(prompts):
            timed.append(s.duration_s)
    for seq in seqs:
        loop.abort(seq.request_id)
    loop.run_while(engine.has_unfinished)
    return timed


def parse_peers(specs: list[str], known: dict) -> dict[str, str]:
    """--peer NAME=PYTHON flags -> {name: python}, refusing malformed or unknown ones."""
    peers = {}
    for spec in specs:
        name, sep, python = spec.partition("=")
        if not sep or not python:
            raise ValueError(f"--peer {spec!r}: expected NAME=PATH_TO_PYTHON")
        peers[name] = python
    unknown = set(peers) - set(known)
    if unknown:
        raise ValueError(f"unknown peer(s) {sorted(unknown)}; known: {sorted(known)}")
    return peers


def run_peer(name: str, python: str, args: dict, script: str | None = None) -> dict:
    """Run a peer's standalone script (default: its latency script) in the peer's Python."""
    script = Path(__file__).parent / "peers" / (script or PEER_SCRIPTS[name])
    env = dict(os.environ)
    if name == "vllm":
        env.update(vllm_env(python, args["threads"]))
    t = time.perf_counter()
    proc = subprocess.run(
        [python, str(script), json.dumps(args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    if proc.returncode != 0:
        return {"status": "FAILED", "stderr_tail": proc.stderr[-3000:]}
    result = None
    for line in reversed(proc.stdout.strip().splitlines()):  # peers may log after it
        if line.startswith("{"):
            result = json.loads(line)
            break
    if result is None:
        return {
            "status": "FAILED",
            "stderr_tail": proc.stderr[-3000:],
            "stdout_tail": proc.stdout[-3000:],
        }
    return {"status": "OK", "python": python, "wall_s": time.perf_counter() - t, **result}


def summarise(results: dict) -> dict:
    return {k: statistics.median(v) for k, v in results.items() if k.endswith("_tok_s") and v}


def run_latency(args, peers: dict[str, str] | None = None, not_run: dict | None = None) -> Path:
    """Measure ours, then each peer ({name: its python}, default from --peer flags); peers
    in not_run ({name: reason}) are recorded as NOT_RUN."""
    import torch

    from tokenworks import LLM
    from tokenworks.bench.ceilings import machine_ceilings, shares

    peers = parse_peers(args.peer, PEER_SCRIPTS) if peers is None else peers
    threads = args.threads or 2
    # The same prompt is timed repeatedly: a prefix-cache hit would time nothing.
    llm = LLM(
        args.model, **{**engine_kwargs(args), "threads": threads, "enable_prefix_caching": False}
    )
    prompt = latency_prompt(args.prompt_tokens, llm.engine.spec.vocab_size)
    short = prompt[:SHORT_PROMPT_TOKENS]
    ours = measure_tokenworks(llm, prompt, short, args.decode_tokens, args.repeats)
    summary = {"tokenworks": summarise(ours)}
    torch.set_num_threads(threads)  # the ceilings with the run's threads
    ceilings = machine_ceilings()
    ours_shares = shares(llm.engine, summary["tokenworks"].get("decode_tok_s"),
                         summary["tokenworks"].get("prefill_tok_s"), ceilings)  # fmt: skip
    peer_results = {name: {"status": "NOT_RUN", "reason": r} for name, r in (not_run or {}).items()}
    peer_args = {
        "gguf": llm.engine.loaded.file_path,
        "hf_dir": args.hf_dir or "",
        "prompt": prompt,
        "short": short,
        "decode_tokens": args.decode_tokens,
        "repeats": args.repeats,
        "threads": threads,
    }
    for name, python in peers.items():
        print(f"measuring peer {name} with {python}")
        peer_results[name] = run_peer(name, python, peer_args)
        if peer_results[name]["status"] == "OK":
            summary[name] = summarise(peer_results[name])
    ratios = {}
    for name, s in summary.items():
        if name != "tokenworks":
            ratios[name] = {k: summary["tokenworks"][k] / v for k, v in s.items() if v}
    record = make_record(
        kind="latency",
        engine=llm.config.to_dict(),
        model=model_record(llm),
        workload={
            "prompt_tokens": args.prompt_tokens,
            "short_prompt_tokens": SHORT_PROMPT_TOKENS,
            "decode_tokens": args.decode_tokens,
            "repeats": args.repeats,
            "threads": threads,
            "prompt_ids": prompt,
            "eos": "ignored",
            "sampling": "greedy",
        },
        results={
            "tokenworks": ours,
            "summary_median": summary,
            "ratio_tokenworks_to_peer": ratios,
            "ceilings": ceilings,
            "shares": ours_shares,
        },  # fmt: skip
        seeds=[0],
        peers=peer_results,
    )
    path = write_record(record, args.out)
    shown = {"summary_median": summary, "ratios": ratios, "shares": ours_shares}
    print(json.dumps(shown, indent=2))
    print(f"record: {path}")
    return path
