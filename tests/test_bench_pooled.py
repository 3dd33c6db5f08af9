"""`tokenworks bench pool`: offline-throughput records pooled round by round against a peer.

The arithmetic on records written here the way `bench throughput` writes them, then the
committed records of one offline workload, whose own per-round ratios the pool must
reproduce."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from tokenworks.bench.pooled import machine_key, pool, workload_key
from tokenworks.bench.report import load_records
from tokenworks.cli import main

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
MANIFEST = {"kind": "random", "num_requests": 64, "threads": 2, "arrival": "offline"}


XEON = {"cpu": "Intel(R) Xeon(R) Processor", "cores": 2, "memory_bytes": 25276510208, "gpu": None}


def _record(
    path: Path, ours, vllm, *, rounds=None, dirty=False, created=0.0, manifest=None, hw=None
):
    """A throughput record as bench throughput writes one: our rounds, the peer's rounds,
    the figures the medians (a single round keeps no rounds list)."""
    results = {"tokenworks": {"output_tok_s": statistics.median(ours)}}
    peer = {"status": "OK", "output_tok_s": statistics.median(vllm)}
    if len(ours) > 1:
        results["tokenworks"]["rounds"] = [{"output_tok_s": x} for x in ours]
        peer["rounds"] = list(vllm)
    record = {
        "kind": "throughput",
        "created_unix": created,
        "git": {"commit": "abc1234def", "dirty": dirty},
        "workload": {"manifest": {**(manifest or MANIFEST), "rounds": rounds or len(ours)}},
        "hardware": hw or XEON,
        "results": results,
        "peers": {"vllm": peer, "sglang": {"status": "NOT_RUN", "reason": "not installed"}},
    }
    path.write_text(json.dumps(record))
    return path


def test_rounds_pair_up_and_the_summary_counts_them(tmp_path):
    a = _record(tmp_path / "a.json", [900, 1000, 800], [600, 800, 800], created=2.0)
    b = _record(tmp_path / "b.json", [700], [500], created=1.0)  # one round, older
    pooled = pool(load_records([a, b]), "vllm", 1.3)
    assert [r.name for r in pooled.runs] == ["b", "a"]  # oldest first
    assert pooled.ratios == pytest.approx([1.4, 1.5, 1.25, 1.0])
    assert pooled.runs[1].ratio_of_medians == pytest.approx(900 / 800)
    s = pooled.summary()
    assert (s["runs"], s["rounds"]) == (2, 4)
    assert s["runs_at_goal"] == 1  # b: 1.4x; a: 1.125x of its medians
    assert s["rounds_at_goal"] == 2  # 1.4 and 1.5
    assert s["rounds_faster"] == 3  # 1.0 is not faster
    assert s["median_round_ratio"] == pytest.approx((1.25 + 1.4) / 2)
    assert (s["lowest_round_ratio"], s["highest_round_ratio"]) == pytest.approx((1.0, 1.5))
    assert s["pooled_ours_tok_s"] == pytest.approx(850)  # of 700, 800, 900, 1000
    assert s["pooled_peer_tok_s"] == pytest.approx(700)  # of 500, 600, 800, 800
    assert s["pooled_ratio"] == pytest.approx(850 / 700)


def test_records_that_cannot_be_pooled_are_left_out_with_the_reason(tmp_path):
    good = _record(tmp_path / "good.json", [900, 950, 1000], [700, 700, 700])
    dirty = _record(tmp_path / "dirty.json", [2000, 2000, 2000], [700, 700, 700], dirty=True)
    pooled = pool(load_records([good, dirty]), "vllm", 1.3)
    assert [r.name for r in pooled.runs] == ["good"]
    assert pooled.skipped == [("dirty", "made from a dirty tree")]
    with pytest.raises(ValueError, match="sglang NOT_RUN: not installed"):
        pool(load_records([good]), "sglang", 1.3)
    with pytest.raises(ValueError, match="no llama.cpp in it"):
        pool(load_records([good]), "llama.cpp", 1.3)
    zero = _record(tmp_path / "zero.json", [900, 950, 1000], [700, 0, 700])
    with pytest.raises(ValueError, match="zero: a round without a positive output tok/s"):
        pool(load_records([zero]), "vllm", 1.3)
    with pytest.raises(ValueError, match="goal 0"):
        pool(load_records([good]), "vllm", 0)


def test_rounds_of_one_workload_pool_whatever_their_count_but_workloads_do_not_mix(tmp_path):
    three = _record(tmp_path / "three.json", [900, 950, 1000], [700, 700, 700])
    five = _record(tmp_path / "five.json", [900] * 5, [700] * 5)
    assert len(pool(load_records([three, five])).ratios) == 8
    other = _record(
        tmp_path / "other.json", [900] * 3, [700] * 3, manifest={**MANIFEST, "num_requests": 32}
    )
    with pytest.raises(ValueError, match="2 different workloads .*other"):
        pool(load_records([three, other]))


def test_records_of_different_machines_do_not_mix(tmp_path):
    """A ratio measured on one CPU says nothing of another's; a few MB more or less
    memory is the same kind of machine."""
    xeon = _record(tmp_path / "xeon.json", [900] * 3, [700] * 3)
    xeon2 = _record(
        tmp_path / "xeon2.json", [900] * 3, [700] * 3, hw={**XEON, "memory_bytes": 2.5e10}
    )
    assert len(pool(load_records([xeon, xeon2])).runs) == 2
    epyc = _record(tmp_path / "epyc.json", [500] * 3, [460] * 3, hw={**XEON, "cpu": "AMD EPYC"})
    with pytest.raises(ValueError, match="2 kinds of machine .*AMD EPYC.*epyc"):
        pool(load_records([xeon, epyc]))


def test_the_committed_records_give_back_their_own_ratios_per_round():
    records = [
        r
        for r in load_records(sorted(RESULTS.glob("throughput-*.json")))
        if r["results"].get("ratio_per_round", {}).get("vllm") and not r["git"]["dirty"]
    ]
    assert len(records) >= 9  # nine runs of one workload, with rounds
    assert len({workload_key(r) for r in records}) == 1  # 3 and 5 rounds: one workload
    machines: dict[str, list] = {}  # the Xeons and the EPYC
    for r in records:
        machines.setdefault(machine_key(r), []).append(r)
    assert len(machines) >= 2
    with pytest.raises(ValueError, match="kinds of machine"):
        pool(records, "vllm", 1.3)
    got = {}
    for group in machines.values():
        pooled = pool(group, "vllm", 1.3)
        got.update({run.name: run.ratios for run in pooled.runs})
        assert pooled.runs[0].ratio_of_medians > 0
    for r in records:
        want = r["results"]["ratio_per_round"]["vllm"]
        assert got[Path(r["_path"]).stem] == pytest.approx(want, rel=1e-12)


def test_the_command_writes_the_table_and_the_plot(tmp_path, capsys):
    a = _record(tmp_path / "run-a.json", [900, 1000, 800], [600, 800, 800])
    b = _record(tmp_path / "run-b.json", [700, 720, 710], [500, 520, 515], created=1.0)
    out = tmp_path / "report"
    assert main(["bench", "pool", str(a), str(b), "--out", str(out), "--goal", "1.3"]) == 0
    printed = capsys.readouterr().out
    assert "2 runs, 6 rounds against vllm" in printed
    md = (out / "pooled-vllm.md").read_text()
    assert "| rounds at 1.3x or more | 4 of 6 |" in md  # a: 1.5x; b: all three (1.38x+)
    assert "`run-b`" in md and "![ratio by round](pooled-vllm.png)" in md
    assert (out / "pooled-vllm.png").stat().st_size > 10_000
    assert main(["bench", "pool", str(a), "--peer", "llama.cpp", "--out", str(out)]) == 2
    assert "no llama.cpp in it" in capsys.readouterr().err
    # files that are no records: a clear error, no traceback
    assert main(["bench", "pool", str(tmp_path / "missing.json"), "--out", str(out)]) == 2
    assert "missing.json: no such record file" in capsys.readouterr().err
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "half.json").write_text('{"kind": ')
    for name, why in [("list.json", "holds a JSON list"), ("half.json", "is not a JSON record")]:
        assert main(["bench", "pool", str(tmp_path / name), "--out", str(out)]) == 2
        assert why in capsys.readouterr().err


def test_the_committed_pooled_report_is_what_its_records_give():
    """benchmarks/report/pooled/pooled-vllm.md (quoted by docs/measurement.md and the
    README) must be what `bench pool` makes of the records its table names."""
    from tokenworks.bench.pooled import markdown

    report = RESULTS.parent / "report" / "pooled" / "pooled-vllm.md"
    names = [
        line.split("`")[1] for line in report.read_text().splitlines() if line.startswith("| `")
    ]
    assert len(names) >= 8
    pooled = pool(load_records([RESULTS / f"{n}.json" for n in names]), "vllm", 1.3)
    assert markdown(pooled, "pooled-vllm.png") == report.read_text()
