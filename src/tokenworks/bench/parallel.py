"""One model split over processes on one machine, against one process with the same cores.

Modes: "one" (one process, all --threads threads), "tp" (tensor parallel over --degree
ranks, or the next size that divides the model's heads; threads shared out), "pp"
(--degree pipeline stages, likewise, a batch in flight for each stage) and "pp-serial"
(the same stages, one batch at a time); all run the torch modules in one dtype on the
weights dequantised alike. For each it measures single-stream decode (seconds a token of
one sequence) and offline throughput (--requests prompts generated together), and on
rank 0 the messages of a decode step (count, bytes, seconds) beside plan/parallel.py's
prediction for the same step over this machine's gloo link, measured in the same run.
"""

from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path

from tqdm import tqdm

from tokenworks.bench.compiled import prompt_of
from tokenworks.bench.record import make_record, write_record

MODES = ("one", "tp", "pp", "pp-serial")


def degree_of(spec, mode: str, asked: int) -> int:
    """The ranks a mode splits this model over: --degree, or for tensor parallelism the
    next size that divides its heads (SmolLM2's 9 query and 3 KV heads take 3)."""
    from tokenworks.models.tensor_parallel import divisors

    if mode == "one":
        return 1
    if mode.startswith("pp"):
        return asked
    return min(s for s in divisors(spec) if s >= asked)


def _config(name: str, mode: str, args, degree: int) -> dict:
    return dict(
        model=name, dtype=args.dtype, quantization="none", kernels="torch", warmup=False,
        enable_prefix_caching=False, max_num_seqs=args.requests,
        threads=max(1, args.threads // degree),
        tensor_parallel_size=degree if mode == "tp" else 1,
        pipeline_parallel_size=degree if mode.startswith("pp") else 1,
        pipeline_batches=1 if mode == "pp-serial" else None,
    )  # fmt: skip


def measure(name: str, mode: str, args, link) -> dict:
    from tokenworks import LLM, SamplingParams
    from tokenworks.engine.rank import comms_of
    from tokenworks.models import load
    from tokenworks.plan import parallel

    degree = degree_of(load(name, weights=False).spec, mode, args.degree)
    llm = LLM(**_config(name, mode, args, degree))
    eng, loop = llm.engine, llm.loop
    try:
        vocab = eng.spec.vocab_size
        once = SamplingParams(max_tokens=args.decode + 2, temperature=0, ignore_eos=True)
        seq = loop.add_request(prompt_of(args.prompt, vocab, 1), once)
        # the prompt, and the first decode step (buffers sized)
        loop.run_while(lambda: len(seq.output_ids) < 2)
        counters = comms_of(eng.model)
        for c in counters:
            c.reset()
        # a token at a time (a pipeline's step may only launch one, and return none)
        steps = []
        for _ in range(args.decode):
            n, t0 = len(seq.output_ids), time.perf_counter()
            loop.run_while(lambda n=n: len(seq.output_ids) == n)
            steps.append(time.perf_counter() - t0)
        loop.run_while(eng.has_unfinished)
        comms = {"count": {}, "bytes": {}, "seconds": {}}
        for c in counters:
            for key, table in (("count", c.count), ("bytes", c.nbytes), ("seconds", c.seconds)):
                for kind, v in table.items():
                    comms[key][kind] = comms[key].get(kind, 0) + v / args.decode
        prompts = [prompt_of(args.prompt, vocab, 10 + i) for i in range(args.requests)]
        params = SamplingParams(max_tokens=args.decode, temperature=0, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        generated = sum(len(o.outputs[0].token_ids) for o in outs)
        shape, act = eng.spec.shape, eng.pool.k[0].element_size()
        row = {
            "decode_step_s": statistics.median(steps),
            "decode_tok_s": 1 / statistics.median(steps),
            "offline_tok_s": generated / wall,
            "offline_seconds": wall,
            "comms_per_decode_step": comms,
            "ranks": degree,
            "threads_per_rank": eng.config.threads,
            "batches_in_flight": eng.in_flight,
        }
        if mode == "tp":
            t = parallel.tensor_traffic(shape, 1, 1, act)
            row["predicted_per_decode_step"] = {
                "count": {"all_reduce": t.allreduces, "all_gather": t.allgathers},
                "bytes": {"all_reduce": t.allreduces * t.allreduce_bytes,
                          "all_gather": t.allgather_bytes},
                "seconds": parallel.tensor_seconds(t, degree, link),
            }  # fmt: skip
        elif mode.startswith("pp"):
            t = parallel.pipeline_traffic(shape, 1, 1, degree, act)
            row["predicted_per_decode_step"] = {
                "count": t.sends,
                "bytes": t.send_bytes,
                "seconds": parallel.pipeline_seconds(shape, 1, 1, degree, act, 1, link),
            }  # fmt: skip
        return row
    finally:
        eng.close()
        del llm, eng
        gc.collect()


def run_parallel_bench(args) -> Path:
    from tokenworks.plan.parallel import fit_link
    from tokenworks.plan.probe import probe_link

    sizes, seconds = probe_link(args.degree)
    link = fit_link(sizes, seconds, args.degree)
    modes = list(args.modes)
    rows = {}
    for name in args.models:
        for mode in tqdm(modes, desc=name):
            rows.setdefault(name, {})[mode] = measure(name, mode, args, link)
    record = make_record(
        kind="parallel",
        engine={m: _config("MODEL", m, args, args.degree) for m in modes},
        model={"names": list(args.models)},
        workload={
            "prompt": args.prompt,
            "decode_tokens": args.decode,
            "offline_requests": args.requests,
            "degree": args.degree,
            "threads": args.threads,
            "sampling": "greedy",
        },
        results={
            "rows": rows,
            "link": {"sizes": sizes, "allreduce_seconds": seconds, "fitted": link.__dict__},
        },
    )
    path = write_record(record, args.out)
    print(table(rows))
    print(f"record: {path}")
    return path


def table(rows: dict) -> str:
    out = ["| model / mode | decode ms | decode tok/s | offline tok/s | messages a step | "
           "comm ms a step |", "|---|---|---|---|---|---|"]  # fmt: skip
    for name, modes in rows.items():
        for mode, r in modes.items():
            c = r["comms_per_decode_step"]
            out.append(
                f"| {name} {mode} | {r['decode_step_s'] * 1e3:.1f} | {r['decode_tok_s']:.1f} | "
                f"{r['offline_tok_s']:.1f} | {sum(c['count'].values()):.0f} | "
                f"{sum(c['seconds'].values()) * 1e3:.2f} |"
            )
    return "\n".join(out)
