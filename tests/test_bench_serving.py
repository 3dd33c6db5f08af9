"""The measurement stage: metric definitions on hand-computed timelines, arrival processes,
workload manifests, and the load generator against a real server on 127.0.0.1."""

from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import json
import math
import statistics

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tokenworks.bench.client import run_load
from tokenworks.bench.metrics import RequestResult, compute, percentile
from tokenworks.bench.server_counters import server_counters, server_figures
from tokenworks.bench.workload import (
    BenchRequest,
    WorkloadError,
    arrival_offsets,
    build_requests,
    sample_length,
)
from tokenworks.engine.prefix_cache import MISS_REASONS


def test_metrics_on_hand_computed_timelines():
    a = RequestResult(
        start=0.0, input_tokens=10, output_tokens=4, chunk_times=[0.5, 0.7, 1.0, 1.1], end=1.2
    )
    b = RequestResult(start=1.0, input_tokens=20, output_tokens=1, chunk_times=[1.3], end=1.4)
    failed = RequestResult(
        start=0.5, input_tokens=99, output_tokens=0, end=0.6, ok=False, error="HTTP 429"
    )
    f = compute([a, b, failed], duration=2.0, slos={"ttft": 0.4})
    assert (f["completed"], f["failed"]) == (2, 1)
    assert f["input_tokens"] == 30 and f["output_tokens"] == 5
    assert f["request_throughput"] == 1.0 and f["output_throughput"] == 2.5
    assert f["total_token_throughput"] == 17.5
    assert f["ttft_s"]["mean"] == pytest.approx((0.5 + 0.3) / 2)
    # TPOT = (E2E - TTFT) / (out - 1): only a has more than one token
    assert f["tpot_s"]["n"] == 1 and f["tpot_s"]["mean"] == pytest.approx((1.2 - 0.5) / 3)
    # ITL pooled over chunk gaps: 0.2, 0.3, 0.1 (b has one chunk, failed has none)
    assert f["itl_s"]["n"] == 3 and f["itl_s"]["mean"] == pytest.approx(0.2)
    assert f["e2e_s"]["median"] == pytest.approx((1.2 + 0.4) / 2)
    assert f["goodput"] == 0.5  # only b's TTFT (0.3 s) meets 0.4 s
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([5], 99) == 5


def test_poisson_and_gamma_arrivals():
    n, rate = 4000, 10.0
    gaps = lambda xs: [b - a for a, b in zip(xs, xs[1:], strict=False)]  # noqa: E731
    poisson = gaps(arrival_offsets(n, rate, 1.0, seed=1))
    mean = statistics.fmean(poisson)
    cv = statistics.pstdev(poisson) / mean
    # exponential gaps: mean 1/rate, coefficient of variation 1 (5 sigma bounds)
    assert abs(mean - 0.1) < 5 * 0.1 / n**0.5
    assert abs(cv - 1.0) < 0.1
    bursty = gaps(arrival_offsets(n, rate, 0.25, seed=1))
    smooth = gaps(arrival_offsets(n, rate, 4.0, seed=1))
    for g, shape in ((bursty, 0.25), (smooth, 4.0)):
        assert statistics.fmean(g) == pytest.approx(0.1, rel=0.15)
        assert statistics.pstdev(g) / statistics.fmean(g) == pytest.approx(shape**-0.5, rel=0.15)
    assert arrival_offsets(3, None) == [0.0, 0.0, 0.0]
    assert arrival_offsets(5, 2.0, seed=7) == arrival_offsets(5, 2.0, seed=7)
    # a ramp from 2 to 20 req/s: the last quarter's gaps are far shorter than the first's
    ramp = gaps(arrival_offsets(n, 2.0, 1.0, seed=1, ramp_to=20.0))
    first, last = statistics.fmean(ramp[: n // 4]), statistics.fmean(ramp[-n // 4 :])
    assert first > 3 * last
    # the gap at fraction f of the run has mean 1 / (2 + 18 f): integrate over the quarters
    assert first == pytest.approx(math.log(6.5 / 2) / 18 / 0.25, rel=0.1)
    with pytest.raises(ValueError, match="ramp_to"):
        arrival_offsets(3, 1.0, ramp_to=0.0)


def test_workload_manifests(tmp_path):
    m = {
        "kind": "random",
        "num_requests": 50,
        "seed": 3,
        "input": {"dist": "lognormal", "mean": 64, "sigma": 0.5, "min": 4, "max": 300},
        "output": {"dist": "uniform", "low": 2, "high": 9},
    }
    reqs = build_requests(m, 49152)
    assert reqs == build_requests(m, 49152)  # seeded: the same for every engine
    assert all(4 <= r.input_len <= 300 and 2 <= r.max_tokens <= 9 for r in reqs)
    assert len({r.input_len for r in reqs}) > 10
    shared = build_requests(
        {
            "kind": "shared_prefix",
            "num_requests": 6,
            "groups": 2,
            "prefix_len": 32,
            "input": 8,
            "output": 4,
        },
        49152,
    )
    assert shared[0].prompt_ids[:32] == shared[2].prompt_ids[:32] != shared[1].prompt_ids[:32]
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"w{i}" for i in range(500)))
    cut = build_requests({"kind": "text", "path": str(text), "num_requests": 3, "input": 20}, 10)
    assert all(len(r.prompt.split()) == 20 for r in cut)
    jl = tmp_path / "r.jsonl"
    jl.write_text(
        json.dumps({"prompt": "hi", "max_tokens": 3})
        + "\n"
        + json.dumps({"prompt": [5, 6], "max_tokens": 2})
        + "\n"
    )
    rows = build_requests({"kind": "jsonl", "path": str(jl)}, 10)
    assert [(r.prompt, r.prompt_ids, r.max_tokens) for r in rows] == [
        ("hi", None, 3),
        (None, [5, 6], 2),
    ]
    with pytest.raises(WorkloadError):
        build_requests({"kind": "nope"}, 10)
    with pytest.raises(WorkloadError):
        sample_length({"dist": "zipf"}, None)


def scrape(url: str) -> dict:
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0) + s.value
    return out


def test_load_generator_totals_equal_the_servers_counters(smol_core_server):
    manifest = {
        "kind": "random",
        "num_requests": 6,
        "seed": 1,
        "input": 24,
        "output": {"dist": "uniform", "low": 3, "high": 8},
    }
    requests = build_requests(manifest, smol_core_server.engine.spec.vocab_size)
    before = scrape(smol_core_server.url)
    results, duration = asyncio.run(
        run_load(
            smol_core_server.url,
            "smollm2-135m",
            requests,
            rate=20.0,
            max_concurrency=3,
            progress=False,
        )
    )
    after = scrape(smol_core_server.url)
    assert all(r.ok for r in results)
    assert [r.output_tokens for r in results] == [r.max_tokens for r in requests]  # EOS ignored
    assert all(r.input_tokens == 24 for r in results)
    delta = lambda name: after[name] - before.get(name, 0)  # noqa: E731
    assert delta("tokenworks:generation_tokens_total") == sum(r.output_tokens for r in results)
    assert delta("tokenworks:prompt_tokens_total") == sum(r.input_tokens for r in results)
    assert delta("tokenworks:request_success_total") == len(requests)
    f = compute(results, duration)
    assert f["completed"] == 6 and f["ttft_s"]["n"] == 6 and f["itl_s"]["n"] > 0


def test_text_prompts_go_to_the_chat_endpoint_when_asked(smol_core_server):
    reqs = [BenchRequest(None, "Name a colour.", 4), BenchRequest(None, "Say hi.", 4)]
    results, _ = asyncio.run(
        run_load(smol_core_server.url, "smollm2-135m", reqs, endpoint="chat", progress=False)
    )
    assert all(r.ok and r.output_tokens == 4 and r.chunk_times for r in results)
    # the chat template wraps the prompt: more prompt tokens than the bare text has
    bare = len(smol_core_server.engine.tokenizer.encode("Name a colour."))
    assert results[0].input_tokens > bare
    ids = [BenchRequest([1, 2, 3], None, 4)]
    with pytest.raises(ValueError, match="chat endpoint takes text"):
        asyncio.run(run_load(smol_core_server.url, "smollm2-135m", ids, endpoint="chat"))


def test_failed_requests_are_counted_not_timed(smol_core_server):
    from tokenworks.bench.workload import BenchRequest

    bad = [BenchRequest([10**9], None, 4)]  # outside the vocabulary: a 400
    results, duration = asyncio.run(
        run_load(smol_core_server.url, "smollm2-135m", bad, progress=False)
    )
    assert not results[0].ok and "400" in results[0].error
    f = compute(results, duration)
    assert f["failed"] == 1 and f["ttft_s"] is None


def test_a_serving_record_holds_what_design_names(smol_core_server, tmp_path):
    from tokenworks.bench.configs import ServeBenchConfig
    from tokenworks.bench.serving import run_serving, summary_table

    args = ServeBenchConfig(
        num_prompts=4,
        input_tokens=16,
        output_tokens=4,
        request_rate=(50.0,),
        max_concurrency=(2,),
        slo_ttft=5.0,
        warmup_requests=0,
        base_url=smol_core_server.url,
        served_model="smollm2-135m",
        api_key=None,
        vocab_size=smol_core_server.engine.spec.vocab_size,
        out=str(tmp_path),
    )
    record = json.loads(run_serving(args).read_text())
    for key in (
        "command",
        "git",
        "hardware",
        "software",
        "engine",
        "model",
        "workload",
        "seeds",
        "results",
    ):
        assert key in record
    assert record["git"]["commit"] and "dirty" in record["git"]
    assert record["workload"]["sha256"] and record["workload"]["manifest"]["kind"] == "random"
    runs = record["results"]["runs"]
    # each point sends prompts of its own seed: none repeats an earlier point's (a prefix
    # cache would answer those without work)
    assert [r["point"] for r in runs] == [
        {"rate": 50.0, "seed": 0},
        {"max_concurrency": 2, "seed": 1},
    ]
    from tokenworks.bench.serving import point_requests

    requests_for = point_requests(record["workload"]["manifest"], 49152)
    first, second = requests_for(0), requests_for(1)
    assert first[0].prompt_ids != second[0].prompt_ids and requests_for(0) is first
    for run in runs:
        assert run["figures"]["completed"] == 4 and "goodput" in run["figures"]
        assert len(run["requests"]) == 4 and run["requests"][0]["chunk_times"]
        # our server's own time per request outside the engine (the prompts are token ids)
        api = run["api_process_s"]
        assert {"parse", "detokenize", "respond"} <= set(api)
        assert 0 < api["total"] < 1 and api["total"] == pytest.approx(
            sum(v for k, v in api.items() if k != "total")
        )
    table = summary_table(record)
    assert table.count("\n") == 3 and '{"rate": 50.0}' in table

    # a peer that is not there: a NOT_RUN record, never a figure
    nobody = dataclasses.replace(args, base_url="http://127.0.0.1:9")  # the discard port
    missing = json.loads(run_serving(nobody).read_text())
    assert missing["status"] == "NOT_RUN" and "no server answers" in missing["reason"]
    assert missing["results"] == {}

    from tokenworks.bench.report import compare_table, load_records, render

    paths = sorted(tmp_path.glob("serving-*.json"))
    records = load_records(paths)
    report = render(records, tmp_path / "report")
    text = report.read_text()
    assert "| point | ok |" in text and "NOT_RUN" in text
    pngs = sorted(p.name for p in (tmp_path / "report").glob("*.png"))
    assert any(n.endswith("latency-throughput.png") for n in pngs)
    assert any(n.endswith("distributions.png") for n in pngs)
    assert any(n.endswith("goodput.png") for n in pngs)
    for png in (tmp_path / "report").glob("*.png"):
        assert png.read_bytes()[:4] == b"\x89PNG"
    ok = [r for r in records if r.get("status") != "NOT_RUN"][0]
    table = compare_table([ok, ok, missing])
    assert "(1.00x)" in table and "NOT_RUN" in table
    idle = copy.deepcopy(ok)  # a first engine that produced nothing: no ratio, no crash
    for run in idle["results"]["runs"]:
        run["figures"]["output_throughput"] = 0.0
    table = compare_table([idle, ok])
    assert "0.0 (-)" in table and "x)" not in table  # every ratio is against the first


def test_in_process_load_is_timed_like_http(toy_llm):
    from tokenworks.bench.client import run_in_process
    from tokenworks.config import EngineConfig
    from tokenworks.engine.engine import LLMEngine
    from tokenworks.front.core_client import CoreClient

    engine = LLMEngine(EngineConfig(model="toy", dtype="float32"), toy_llm.engine.loaded)
    front = CoreClient(engine=engine)
    front.start()
    try:
        reqs = build_requests(
            {"kind": "random", "num_requests": 5, "input": 6, "output": 7}, engine.spec.vocab_size
        )
        results, duration = asyncio.run(
            run_in_process(front, reqs, rate=100.0, max_concurrency=2, progress=False)
        )
    finally:
        front.shutdown()
    assert all(r.ok and r.output_tokens == 7 and r.input_tokens == 6 for r in results)
    f = compute(results, duration)
    assert f["completed"] == 5 and f["tpot_s"]["n"] == 5


def test_multi_turn_chats_send_the_conversation_so_far(smol_core_server):
    manifest = {
        "kind": "multi_turn",
        "num_requests": 2,
        "turns": 3,
        "input": 12,
        "output": 6,
        "seed": 4,
    }
    requests = build_requests(manifest, smol_core_server.engine.spec.vocab_size)
    assert all(len(r.turns) == 3 for r in requests)
    before = scrape(smol_core_server.url)
    counted = server_counters(smol_core_server.url, None)
    results, duration = asyncio.run(
        run_load(smol_core_server.url, "smollm2-135m", requests, progress=False)
    )
    after = scrape(smol_core_server.url)
    misses = server_figures(counted, server_counters(smol_core_server.url, None))["prefix_misses"]
    # every request is told why its prompt missed where it did (its tail, at least)
    assert sum(misses.values()) == 6 and set(misses) <= set(MISS_REASONS)
    assert len(results) == 6 and all(r.ok and r.output_tokens == 6 for r in results)
    # results come conversation by conversation: each turn's prompt holds the earlier ones
    for conv in (results[:3], results[3:]):
        assert conv[0].input_tokens < conv[1].input_tokens < conv[2].input_tokens
    hits = (
        after["tokenworks:prefix_cache_hits_total"] - before["tokenworks:prefix_cache_hits_total"]
    )
    assert hits > 0  # later turns reuse the earlier turns' KV blocks


def test_sweep_points_draw_fresh_prompts_from_the_manifests_seed():
    from tokenworks.bench.serving import point_label, sweep_points

    args = argparse.Namespace(seed=0, request_rate=[1.0, 2.0], max_concurrency=[4], ramp=[])
    assert [p["seed"] for p in sweep_points(args)] == [0, 1, 2]
    points = sweep_points(args, base_seed=7)  # a manifest's own seed comes first
    assert [p["seed"] for p in points] == [7, 8, 9]
    assert point_label(points[2]) == '{"max_concurrency": 4}'
