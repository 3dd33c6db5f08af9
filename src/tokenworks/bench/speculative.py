"""Speculative decoding measured: speed-up over no speculation, acceptance and mean
accepted length, per method and k, on a copy-heavy and a free-text workload, at batch 1
and at a concurrency; `tokenworks plan spec`'s prediction beside each; llama.cpp's n-gram
lookup on the same GGUF as the peer.

Every configuration runs each cell (workload x concurrency) in turn, the baseline among
them, so the machine's drift lands on all of them alike. Batch 1 generates the cell's
prompts one at a time; a concurrency of N submits N at once. Greedy, EOS honoured.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path

from tqdm import tqdm

from tokenworks.bench.latency import run_peer
from tokenworks.bench.record import make_record, model_record, write_record
from tokenworks.bench.speculative_prompts import WORKLOADS
from tokenworks.config import engine_kwargs
from tokenworks.engine.request import SamplingParams
from tokenworks.engine.speculative import open_speculator
from tokenworks.plan.speculative import expected_tokens, speedup

BASELINE = "off"


def configurations(args) -> dict[str, dict | None]:
    """name -> speculative_config (None: off), from --methods and --k."""
    out: dict[str, dict | None] = {BASELINE: None}
    for method in args.methods:
        for k in args.k:
            config = {"method": method, "num_speculative_tokens": k}
            if method == "draft_model":
                if not args.draft_model:
                    raise ValueError("--methods draft_model needs --draft-model NAME")
                config["model"] = args.draft_model
            out[f"{method}-k{k}"] = config
    return out


def run_cell(llm, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    """Generate the cell's prompts; its time, tokens, outputs and what speculation did."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    spec = llm.engine.speculator
    # a copy of the counts now (the list too: the speculator appends in place)
    m = spec.metrics if spec else None
    before = dataclasses.replace(m, accepted_per_pos=list(m.accepted_per_pos)) if m else None
    n_stats = len(llm.engine.stats)
    t = time.perf_counter()
    outs = []
    if concurrency == 1:
        for p in prompts:
            outs += llm.generate([p], params, use_tqdm=False)
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t
    stats = list(llm.engine.stats)[n_stats:]
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {
        "seconds": seconds,
        "output_tokens": tokens,
        "output_tok_s": tokens / seconds,
        "steps": len(stats),
        "token_ids": [o.outputs[0].token_ids for o in outs],
    }
    decode = [s.duration_s for s in stats if s.prefill_tokens == 0]
    verify = [s.duration_s for s in stats if s.spec_draft_tokens and s.prefill_tokens == 0]
    plain = [s.duration_s for s in stats if not s.spec_draft_tokens and s.prefill_tokens == 0]
    result["decode_step_s_median"] = statistics.median(decode) if decode else None
    result["verify_step_s_median"] = statistics.median(verify) if verify else None
    result["plain_step_s_median"] = statistics.median(plain) if plain else None
    if spec is not None:
        delta = spec.metrics.since(before).to_dict()
        drafts = delta["num_drafts"]
        delta["mean_proposed"] = delta["num_draft_tokens"] / drafts if drafts else None
        delta["verify_steps"] = len(verify)
        delta["decode_steps"] = len(decode)  # the others found nothing to propose
        result["speculative"] = delta
    return result


def predict(cell: dict, baseline: dict, method: str) -> dict:
    """plan spec's prediction from this cell's measured acceptance and costs, and what
    it leaves out (a verify step costs more than a plain one)."""
    s = cell.get("speculative") or {}
    if not s.get("num_drafts"):
        return {"status": "no proposal was verified"}
    accepted = s["num_accepted_tokens"]
    # per-guess acceptance: each accepted guess one success, each rejection one failure
    trials = accepted + s["num_rejections"]
    alpha = min(accepted / trials, 0.999) if trials else 0.0
    k = max(1, round(s["mean_proposed"]))
    verify_s = cell["verify_step_s_median"]
    plain_s = baseline["plain_step_s_median"] or baseline["decode_step_s_median"]
    rounds = k if method == "draft_model" else 1
    draft_s = s["draft_seconds"] / max(1, s["verify_steps"]) / rounds
    c = draft_s / verify_s if verify_s else 0.0
    out = {
        "alpha": alpha,
        "k": k,
        "draft_to_verify_cost": c,
        "plan_spec_speedup": speedup(alpha, k, c),
        "expected_tokens_per_verify": expected_tokens(alpha, k),
        "measured_speedup": cell["output_tok_s"] / baseline["output_tok_s"],
        "acceptance_rate": s["acceptance_rate"],
    }
    out["verify_fraction_of_decode_steps"] = s["verify_steps"] / max(1, s["decode_steps"])
    if verify_s and plain_s:
        # the plan counts a verify step as one plain step; here it costs this many
        out["verify_to_plain_step"] = verify_s / plain_s
        out["speedup_with_measured_verify_cost"] = expected_tokens(alpha, k) / (
            verify_s / plain_s + (k * draft_s if method == "draft_model" else draft_s) / plain_s
        )
    return out


def run_peer_llamacpp(python: str, gguf: str, cells: dict, args) -> dict:
    """llama.cpp with and without its n-gram lookup, batch 1, the same prompts."""
    configs = [{"name": BASELINE}] + [
        {"name": f"ngram-k{k}", "num_pred_tokens": int(k), "max_ngram_size": 4} for k in args.k
    ]
    out = {}
    for (workload, conc), prompt_ids in cells.items():
        if conc != 1:
            continue
        peer_args = {
            "gguf": gguf,
            "prompts": prompt_ids,
            "max_tokens": args.max_tokens,
            "threads": args.threads or 2,
            "configs": configs,
        }
        out[workload] = run_peer("llama.cpp", python, peer_args, "llamacpp_speculative.py")
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = list(results)
    names = [n for n in next(iter(results.values())) if n != BASELINE]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(cells) * len(names) / 3), 4))
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        ys = [results[c][name]["output_tok_s"] / results[c][BASELINE]["output_tok_s"]
              for c in cells]  # fmt: skip
        ax.bar([x + i * width for x in range(len(cells))], ys, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([x + width * (len(names) - 1) / 2 for x in range(len(cells))], cells)
    ax.set_ylabel("speed-up over no speculation")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run_speculative(args) -> Path:
    from tokenworks import LLM
    from tokenworks.models import load

    threads = args.threads or 2
    loaded = load(args.model)
    draft = load(args.draft_model) if args.draft_model else None
    concurrencies = list(args.concurrency)
    kw = {**engine_kwargs(args), "threads": threads, "enable_prefix_caching": False,
          "max_num_seqs": max(concurrencies)}  # fmt: skip
    kw.pop("speculative_config", None)
    configs = configurations(args)
    # one engine; each configuration is a speculator swapped into it (drafters shared), so
    # the target's weights are in memory once
    llm = LLM(args.model, loaded=loaded, **kw)
    speculators, built, engine_configs = {}, {}, {}
    for name, config in tqdm(configs.items(), desc="speculators"):
        engine_configs[name] = dataclasses.replace(llm.config, speculative_config=config)
        speculators[name] = open_speculator(
            engine_configs[name], loaded, llm.engine.blocks.num_blocks, draft, built
        )
    for weights in (loaded.weights, draft.weights if draft else {}):
        weights.clear()  # the engine and drafters hold their own copies now
    tok = llm.tokenizer
    cells, prompt_ids = {}, {}
    for workload in args.workloads:
        conversations = WORKLOADS[workload]()
        texts = [tok.apply_chat_template(c, add_generation_prompt=True) for c in conversations]
        for conc in concurrencies:
            chosen = texts[:: max(1, len(texts) // args.requests)][: args.requests]
            # a concurrency of N: 3N requests through N slots, so N stay in flight (a
            # closed batch of N would wait on its longest request whatever the others gain)
            chosen = chosen if conc == 1 else (texts * 3 * conc)[: 3 * conc]
            cells[(workload, conc)] = chosen
            prompt_ids[(workload, conc)] = [tok.encode(t) for t in chosen]
    results: dict[str, dict] = {}
    work = [(cell, name) for cell in cells for _ in range(args.rounds) for name in configs]
    for (workload, conc), name in tqdm(work, desc="cells"):
        key = f"{workload}-c{conc}"
        llm.engine.speculator = speculators[name]
        got = run_cell(llm, cells[(workload, conc)], conc, args.max_tokens)
        runs = results.setdefault(key, {}).setdefault(name, [])
        runs.append(got)
    summary: dict[str, dict] = {}
    for key, by_name in results.items():
        for name, runs in by_name.items():
            tok_s = [r["output_tok_s"] for r in runs]
            best = runs[tok_s.index(statistics.median_high(tok_s))]
            summary.setdefault(key, {})[name] = {**best, "rounds_tok_s": tok_s}
    table = {}
    for key, by_name in summary.items():
        base = by_name[BASELINE]
        table[key] = {}
        for name, cell in by_name.items():
            row = {
                "output_tok_s": cell["output_tok_s"],
                "speedup": cell["output_tok_s"] / base["output_tok_s"],
                "same_tokens_as_off": sum(
                    a == b for a, b in zip(cell["token_ids"], base["token_ids"], strict=True)
                ),
                "requests": len(cell["token_ids"]),
            }
            if name != BASELINE:
                s = cell.get("speculative", {})
                row["acceptance_rate"] = s.get("acceptance_rate")
                row["mean_accepted_length"] = s.get("mean_accepted_length")
                row["plan"] = predict(cell, base, configs[name]["method"])
            table[key][name] = row
    peers = {}
    if args.llamacpp_python:
        gguf = llm.engine.loaded.file_path
        peers["llama.cpp"] = run_peer_llamacpp(args.llamacpp_python, gguf, prompt_ids, args)
    else:
        peers["llama.cpp"] = {"status": "NOT_RUN", "reason": "no --llamacpp-python given"}
    record = make_record(
        kind="speculative",
        engine={name: c.to_dict() for name, c in engine_configs.items()},
        model=model_record(llm),
        workload={
            "workloads": args.workloads,
            "concurrency": concurrencies,
            "requests_at_batch_1": args.requests,
            "max_tokens": args.max_tokens,
            "rounds": args.rounds,
            "sampling": "greedy",
            "eos": "honoured",
            "threads": threads,
            "draft_model": args.draft_model,
            "prompts": {f"{w}-c{c}": ids for (w, c), ids in prompt_ids.items()},
        },
        results={"table": table, "cells": summary},
        peers=peers,
    )
    path = write_record(record, args.out)
    plot(summary, path.with_suffix(".png"))
    print(json.dumps(_printable(table), indent=1))
    print(f"record: {path}")
    return path


def _printable(table: dict) -> dict:
    out = {}
    for key, by_name in table.items():
        out[key] = {
            name: {
                "tok_s": round(r["output_tok_s"], 1),
                "speedup": round(r["speedup"], 2),
                "accept": r.get("acceptance_rate") and round(r["acceptance_rate"], 2),
                "plan": (r.get("plan") or {}).get("plan_spec_speedup"),
            }
            for name, r in by_name.items()
        }
    return out
