"""`tokenworks bench serve`: a serving benchmark of any OpenAI-compatible server, one record.

Without --base-url it starts our own server in-process (127.0.0.1, engine flags as for
every command) and also records the engine's per-step stats (--in-process skips HTTP and
submits straight to the engine's front, timed the same way); with --base-url it drives
whatever listens there (vLLM, llama.cpp's server, SGLang, another tokenworks). Each
request rate or concurrency given runs the same manifest once, in order (a sweep).
"""

from __future__ import annotations

import asyncio
import functools
import json
from dataclasses import replace
from pathlib import Path

from tokenworks.bench.client import run_in_process, run_load
from tokenworks.bench.metrics import compute
from tokenworks.bench.record import make_not_run, make_record, model_record, write_record
from tokenworks.bench.server_counters import server_counters, server_figures
from tokenworks.bench.vllm_client import run_vllm_points
from tokenworks.bench.workload import BenchRequest, build_requests, load_manifest
from tokenworks.config import engine_kwargs


def unreachable(base_url: str, api_key: str | None) -> str | None:
    """Why the server at base_url cannot be measured, or None when it answers /v1/models."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    try:
        r = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=10)
    except httpx.HTTPError as e:
        return f"no server answers at {base_url} ({type(e).__name__})"
    if r.status_code != 200:
        return f"{base_url}/v1/models answered HTTP {r.status_code}"
    return None


def default_manifest(args) -> dict:
    return {
        "kind": "random",
        "num_requests": args.num_prompts,
        "seed": args.seed,
        "input": {"dist": "fixed", "value": args.input_tokens},
        "output": {"dist": "fixed", "value": args.output_tokens},
        "ignore_eos": True,
    }


def step_summary(stats) -> dict:
    """Our engine's view of the run: batch sizes, KV usage, prefix hits, preemptions."""
    if not stats:
        return {}
    return {
        "steps": len(stats),
        "mean_batch_size": sum(s.batch_size for s in stats) / len(stats),
        "max_batch_size": max(s.batch_size for s in stats),
        "max_kv_usage": max(s.kv_usage for s in stats),
        "prefix_hit_tokens": sum(s.prefix_hit_tokens for s in stats),
        "preemptions": sum(s.preemptions for s in stats),
        "prefill_tokens": sum(s.prefill_tokens for s in stats),
        "decode_tokens": sum(s.decode_tokens for s in stats),
    }


def run_points(load, points, args, engine=None, warm_up=None, probe=None) -> list:
    """One load run per sweep point ({"rate": r} or {"max_concurrency": c}); load(point)
    returns (results, duration). warm_up() runs first, untimed; probe(), where given, reads
    the server's counters before and after each point (server_counters)."""
    if warm_up is not None:
        warm_up()
    out = []
    slos = {
        k: v
        for k, v in (("ttft", args.slo_ttft), ("tpot", args.slo_tpot), ("e2e", args.slo_e2e))
        if v is not None
    }
    for point in points:
        if engine is not None:
            engine.stats.clear()
        before = probe() if probe is not None else None
        results, duration = load(point)
        figures = compute(results, duration, slos or None)
        entry = {"point": point, "figures": figures, "requests": [r.__dict__ for r in results]}
        if probe is not None:
            entry |= server_figures(before, probe())
        if engine is not None:
            entry["engine_steps"] = step_summary(list(engine.stats))
        out.append(entry)
        ttft = figures["ttft_s"]["median"] if figures["ttft_s"] else float("nan")
        print(
            f"{point}: {figures['completed']} ok, {figures['failed']} failed, "
            f"{figures['output_throughput']:.1f} out tok/s, median TTFT {1000 * ttft:.0f} ms"
        )
    return out


def http_load(base_url, model, requests_for, args, api_key=None):
    """load(point) over HTTP against the server at base_url."""
    endpoint = getattr(args, "endpoint", "completions")

    def head(requests):
        return (base_url, model, requests)

    return _load(run_load, args, requests_for, head, api_key=api_key, endpoint=endpoint)


def in_process_load(front, requests_for, args):
    """load(point) straight into an engine front (front/interface.py)."""
    return _load(run_in_process, args, requests_for, lambda requests: (front, requests))


def _load(runner, args, requests_for, head, **kw):
    """load(point): the point's own requests (requests_for(point's seed)) on its schedule."""

    def load(point):
        seed = point.get("seed", args.seed)
        return asyncio.run(
            runner(
                *head(requests_for(seed)),
                rate=point.get("rate"),
                burstiness=args.burstiness,
                max_concurrency=point.get("max_concurrency"),
                ramp_to=point.get("ramp_to"),
                seed=seed,
                **kw,
            )
        )

    return load


def warm_up_requests(requests_for, args, first_seed: int) -> list[BenchRequest]:
    """--warmup-requests requests of their own seed (prompts no sweep point sends), cut to
    16 output tokens: enough for every engine to build its kernels and graphs for batched
    shapes before anything is timed, without warming a prefix cache for the points."""
    n = getattr(args, "warmup_requests", 0)
    warm = requests_for(first_seed - 1)[:n]
    return [replace(r, max_tokens=min(r.max_tokens, 16)) for r in warm]


def _warm_up(runner, head, requests_for, args, first_seed, **kw):
    """warm_up() for run_points: the warm-up requests all at once (None: no warm-up)."""
    warm = warm_up_requests(requests_for, args, first_seed)
    if not warm:
        return None
    return lambda: asyncio.run(runner(*head(warm), max_concurrency=len(warm), progress=False, **kw))


def http_warm_up(base_url, model, requests_for, args, first_seed, api_key=None):
    head = lambda requests: (base_url, model, requests)  # noqa: E731
    return _warm_up(run_load, head, requests_for, args, first_seed, api_key=api_key)


def in_process_warm_up(front, requests_for, args, first_seed):
    head = lambda requests: (front, requests)  # noqa: E731
    return _warm_up(run_in_process, head, requests_for, args, first_seed)


def sweep_points(args, base_seed: int | None = None) -> list[dict]:
    """The sweep, each point with its own prompt seed (the manifest's seed, else --seed,
    plus the point's index): a point never resends an earlier point's prompts, which a
    prefix cache would answer without work."""
    base = args.seed if base_seed is None else base_seed
    points = [{"rate": r} for r in args.request_rate]
    points += [{"rate": a, "ramp_to": b} for a, b in getattr(args, "ramp", [])]
    points += [{"max_concurrency": c} for c in args.max_concurrency]
    points = points or [{"rate": None}]
    return [{**p, "seed": base + k} for k, p in enumerate(points)]


def point_label(point: dict) -> str:
    """A sweep point as reports show it (the prompt seed left out)."""
    return json.dumps({k: v for k, v in point.items() if k != "seed"})


def point_requests(manifest: dict, vocab_size: int):
    """requests_for(seed): the manifest's requests drawn with that seed (cached)."""
    cache: dict[int, list[BenchRequest]] = {}

    def requests_for(seed: int) -> list[BenchRequest]:
        if seed not in cache:
            cache[seed] = build_requests({**manifest, "seed": seed}, vocab_size)
        return cache[seed]

    return requests_for


def serving_workload(args, manifest: dict | None = None) -> dict:
    """The record's workload: the manifest (read from args unless given), and the sweep."""
    if manifest is None:
        manifest = load_manifest(args.manifest) if args.manifest else default_manifest(args)
    return {
        **manifest,
        "burstiness": args.burstiness,
        "points": sweep_points(args, manifest.get("seed")),
        "warmup_requests": getattr(args, "warmup_requests", 0),
    }


def write_not_run(args, engine_info: dict, reason: str, manifest: dict | None = None) -> Path:
    """A serving record for an engine that could not be measured: why, and no figure."""
    workload = serving_workload(args, manifest)
    record = make_not_run(kind="serving", engine=engine_info, workload=workload, reason=reason)
    if getattr(args, "label", None):
        record["label"] = args.label
    path = write_record(record, args.out)
    print(f"NOT_RUN: {reason}\nrecord: {path}")
    return path


def run_serving(args, engine_extra: dict | None = None) -> Path:
    """Run the sweep and write its record; engine_extra adds to the record's engine (what
    a --base-url server is and how it was started)."""
    manifest = load_manifest(args.manifest) if args.manifest else default_manifest(args)
    points = sweep_points(args, manifest.get("seed"))
    if args.base_url:
        engine_info = {
            "base_url": args.base_url,
            "served_model": args.served_model,
            **(engine_extra or {}),
        }
        vllm_client = getattr(args, "client", "ours") == "vllm"
        if vllm_client:  # vLLM's random dataset, as its client draws it
            manifest = {**default_manifest(args), "kind": "vllm-random"}
            engine_info["client"] = "vllm bench serve"
        reason = unreachable(args.base_url, args.api_key)
        if reason:
            return write_not_run(args, engine_info, reason, manifest)
        probe = functools.partial(server_counters, args.base_url, args.api_key)
        if vllm_client:
            runs = run_vllm_points(args, points, probe)
        else:
            requests_for = point_requests(manifest, args.vocab_size)
            load = http_load(args.base_url, args.served_model, requests_for, args, args.api_key)
            warm = http_warm_up(
                args.base_url, args.served_model, requests_for, args, points[0]["seed"],
                args.api_key,
            )  # fmt: skip
            runs = run_points(load, points, args, warm_up=warm, probe=probe)
        model_info = {"id": args.served_model}
    else:
        from tokenworks import LLM
        from tokenworks.serve.app import build_app
        from tokenworks.serve.server import ServerThread, make_state

        llm = LLM(args.model, **engine_kwargs(args))
        engine = llm.engine
        requests_for = point_requests(manifest, engine.spec.vocab_size)
        state = make_state(engine, [args.model])
        if getattr(args, "in_process", False):  # no HTTP: straight into the async front
            state.engine.start()
            warm = in_process_warm_up(state.engine, requests_for, args, points[0]["seed"])
            try:
                load = in_process_load(state.engine, requests_for, args)
                runs = run_points(load, points, args, engine=engine, warm_up=warm)
            finally:
                state.engine.shutdown()
        else:
            with ServerThread(build_app(state)) as srv:
                load = http_load(srv.url, args.model, requests_for, args)
                warm = http_warm_up(srv.url, args.model, requests_for, args, points[0]["seed"])
                probe = functools.partial(server_counters, srv.url, None)
                runs = run_points(load, points, args, engine=engine, warm_up=warm, probe=probe)
        engine_info = {
            **llm.config.to_dict(),
            "client": "in-process" if getattr(args, "in_process", False) else "http",
        }
        model_info = model_record(llm)
    record = make_record(
        kind="serving",
        engine=engine_info,
        model=model_info,
        workload=serving_workload(args, manifest),
        results={"runs": runs},
        seeds=[args.seed],
    )
    if getattr(args, "label", None):
        record["label"] = args.label
    path = write_record(record, args.out)
    print(f"record: {path}")
    return path


def summary_table(record: dict) -> str:
    """A Markdown table of a serving record's sweep points."""
    rows = [
        "| point | ok | failed | out tok/s | req/s | TTFT p50 ms | TPOT p50 ms | ITL p50 ms |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def ms(fig, key):
        return f"{1000 * fig[key]['median']:.1f}" if fig.get(key) else "-"

    for run in record["results"]["runs"]:
        f = run["figures"]
        rows.append(
            f"| {point_label(run['point'])} | {f['completed']} | {f['failed']} | "
            f"{f['output_throughput']:.1f} | {f['request_throughput']:.2f} | "
            f"{ms(f, 'ttft_s')} | {ms(f, 'tpot_s')} | {ms(f, 'itl_s')} |"
        )
    return "\n".join(rows)
