"""Lab: the book's claims, each checked against the newest record that measures it.

Each lesson is a claim a chapter could make, the record kind that measures it, the figure
(a path in the record, or the ratio of two) and the test the figure must pass. The lab
reads, for each claim, the newest record under --results that holds its figure, says
which claims held and which did not, and keeps the figure and the record's name beside
each: a claim that did not hold is a lesson too. No lesson is measured here; rerun the
labs to move them.

    python labs/lessons.py [--results benchmarks/results]

Writes an evidence record and a PNG (each claim, held or not).
"""

from __future__ import annotations

import argparse
import json
import operator
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from tokenworks.bench.labs import parse_lab_args, save_figure  # noqa: E402
from tokenworks.bench.record import make_record, write_record  # noqa: E402

TESTS = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le,
         "==": operator.eq}  # fmt: skip

# (name, chapter, claim, record kind, figure: a path or (numerator, denominator), test, bound)
LESSONS = [
    ("first_request_pays", 2, "the first request after a start takes longer than the second",
     "lab.cold_start", "rows/smollm2-135m/default/first_over_second", ">", 1.0),
    ("scores_cost_more_than_their_flops", 4,
     "at 1,024 tokens GPT-2's score products take a larger share of the time than of the FLOPs",
     "lab.transformer_anatomy", ("lengths/1024/components/scores/time_share",
                                 "lengths/1024/components/scores/flops_share"), ">", 1.0),
    ("big_products_meet_the_roofline", 11,
     "a 512-row float32 product runs within 10% of the roofline",
     "lab.roofline_ceilings", "operations/15/attained", ">=", 0.9),
    ("roofline_predicts_batched_decode", 11,
     "the roofline predicts a 64-sequence decode step within a factor of 2",
     "lab.roofline_ceilings", "batched_decode/64/measured_over_predicted", "<", 2.0),
    ("int8_kv_fits_more", 12, "an int8 KV cache runs more sequences in the same memory",
     "lab.kv_cache_dtype", ("rows/smollm2-135m/int8/most_running",
                            "rows/smollm2-135m/bf16-c/most_running"), ">", 1.0),
    ("paging_fits_more", 14, "paged blocks fit more sequences than contiguous allocation",
     "lab.paging", "sequences_ratio", ">", 1.0),
    ("paging_is_faster", 14, "and the paged pool generates faster for it",
     "lab.paging", ("rows/paged/tok_s", "rows/contiguous/tok_s"), ">", 1.0),
    ("continuous_beats_static", 15, "continuous batching finishes an offline batch faster",
     "lab.static_vs_continuous", "continuous_over_static", ">", 1.0),
    ("speculation_pays_on_copying", 17, "speculation speeds up text that copies its prompt",
     "lab.speculation", "rows/copy/speedup", ">", 1.0),
    ("speculation_pays_on_free_text", 17, "speculation speeds up free text",
     "lab.speculation", "rows/free/speedup", ">", 1.0),
    ("speculation_meets_its_plan", 17,
     "speculation on copying text reaches most (0.8) of the speed-up its plan predicts",
     "lab.speculation", ("rows/copy/speedup", "rows/copy/plan_speedup"), ">=", 0.8),
    ("naive_gqa_saves_nothing", 21,
     "a grouped-query kernel that copies K and V out per query head is no faster than MHA",
     "lab.kv_heads", ("kernels/naive_gqa/ms", "kernels/mha/ms"), ">=", 1.0),
    ("window_reach_is_exact", 22,
     "a token's influence ends exactly L x (W - 1) positions on through stacked windows",
     "lab.sliding_window", ("reach/4/furthest_influenced", "reach/4/bound"), "==", 1.0),
    ("masked_window_is_faster", 22, "a window that only masks makes long decode no slower",
     "lab.sliding_window", "speed/mask_over_free_torch_4096", "<=", 1.1),
    ("schedule_keeps_tokens", 24, "a change of block size keeps every greedy token",
     "lab.one_change", "changes/block_size_64/same_tokens", "==", 4),
    ("arithmetic_keeps_tokens", 24, "turning batch invariance off keeps every greedy token",
     "lab.one_change", "changes/batch_invariance_off/same_tokens", "==", 4),
    ("bad_requests_get_4xx", 25, "no bad request gets a server error",
     "lab.api_boundary", "summary/server_errors", "==", 0),
    ("prediction_beats_a_bounded_queue", 26,
     "turning away on the predicted wait answers more requests in time than a bounded queue",
     "lab.admission_policies", ("live/predicted_wait/goodput", "live/bounded_queue/goodput"),
     ">", 1.0),
    ("engine_alone_estimates_suffice", 26,
     "service times measured on the engine alone predict well enough (goodput 0.5 or more)",
     "lab.admission_policies", "stale_estimates/from_the_engine_alone/goodput", ">=", 0.5),
    ("a_backlog_limit_cancels_a_slow_reader", 27,
     "a 64-token backlog limit alone cancels a reader that falls behind",
     "lab.many_streams", "slow_reader/backlog_64/cancelled_by_server", "==", True),
    ("a_bounded_socket_lets_it", 27,
     "with each connection's send buffer bounded to 8 KiB, the same limit cancels it",
     "lab.many_streams", "slow_reader/socket_8k_backlog_64/cancelled_by_server", "==", True),
    ("a_gone_client_stops_soon", 27, "the engine stops a hung-up stream within a quarter second",
     "lab.many_streams", "gone_client/engine_ran_after_close_s", "<", 0.25),
    ("tensor_parallel_is_faster", 28,
     "two or more CPU processes by tensor parallelism decode faster than one",
     "parallel", ("rows/smollm2-135m/tp/decode_tok_s", "rows/smollm2-135m/one/decode_tok_s"),
     ">", 1.0),
    ("invariance_is_cheap", 39, "batch-invariant decode keeps 90% of the batch-variant speed",
     "invariance", "invariant_over_variant/decode_tok_s", ">=", 0.9),
    ("decode_matches_llama_cpp", 44,
     "decode of an IQ3_S file keeps up with llama.cpp's on the same file",
     "quantisation", ("qwen2.5-coder-1.5b-IQ3_S/gguf/speed/decode_tok_s",
                      "qwen2.5-coder-1.5b-IQ3_S/llama.cpp/decode_tok_s"), ">=", 1.0),
    ("prefill_matches_llama_cpp", 44,
     "prefill of an IQ3_S file keeps up with llama.cpp's on the same file",
     "quantisation", ("qwen2.5-coder-1.5b-IQ3_S/gguf/speed/prefill_tok_s",
                      "qwen2.5-coder-1.5b-IQ3_S/llama.cpp/prefill_tok_s"), ">=", 1.0),
]  # fmt: skip


def newest(results: Path, kind: str) -> list[Path]:
    """The records of `kind` (named kind-YYYYMMDDTHHMMSSZ.json), newest first."""
    found = sorted(
        (p for p in results.glob(f"{kind}-*.json") if p.stem[len(kind) + 1 :][:8].isdigit()),
        reverse=True,
    )
    if not found:
        raise SystemExit(f"no {kind} record under {results}: run the lab or bench that writes it")
    return found


def measured(paths: list[Path], figure) -> tuple[Path, dict]:
    """The newest record that holds `figure` (records of one kind measure different models
    in different runs: a run of one file does not hide the last run of the others)."""
    for path in paths:
        record = json.loads(path.read_text())
        try:
            value(record, figure)
        except (KeyError, IndexError, TypeError):
            continue
        return path, record
    return paths[0], json.loads(paths[0].read_text())


def value(record: dict, figure):
    if isinstance(figure, tuple):
        return at(record, figure[0]) / at(record, figure[1])
    return at(record, figure)


def at(record: dict, path: str):
    x = record["results"]
    for key in path.split("/"):
        x = x[int(key)] if isinstance(x, list) else x[key]
    return x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--results", default="benchmarks/results", help="where the records are")
    ap.add_argument("--out", default="benchmarks/results")
    args = parse_lab_args(ap, fast={})
    results = Path(args.results)
    out = {}
    for name, chapter, claim, kind, figure, test, bound in LESSONS:
        path, record = measured(newest(results, kind), figure)
        try:
            found = value(record, figure)
        except (KeyError, IndexError, TypeError) as e:
            raise SystemExit(
                f"lesson {name}: {path.name} has no {figure} ({e!r}); the record's "
                "kind changed shape: point the lesson at its new figure"
            ) from None
        held = bool(TESTS[test](found, bound))
        out[name] = {"chapter": chapter, "claim": claim, "record": path.stem,
                     "figure": figure if isinstance(figure, str) else " / ".join(figure),
                     "value": found, "test": f"{test} {bound}", "held": held}  # fmt: skip
        print(f"ch. {chapter:2d} {'held    ' if held else 'NOT HELD'} {claim} "
              f"({found:.3g} {test} {bound}; {path.stem})")  # fmt: skip
    summary = {"lessons": len(out), "held": sum(r["held"] for r in out.values())}
    summary["not_held"] = summary["lessons"] - summary["held"]
    print(f"{summary['held']} of {summary['lessons']} claims held")
    record = make_record(
        kind="lab.lessons",
        engine={"reads": str(results)},
        model={"id": "the records named per lesson"},
        workload={"lessons": len(LESSONS)},
        results={"lessons": out, "summary": summary},
        seeds=[],
    )
    path = write_record(record, args.out)

    fig, ax = plt.subplots(figsize=(9, 0.32 * len(out) + 1))
    names = list(out)
    ax.barh(range(len(names)), [1] * len(names),
            color=["#4477aa" if out[n]["held"] else "#ee6677" for n in names])  # fmt: skip
    ax.set(yticks=range(len(names)), xticks=[],
           yticklabels=[f"ch. {out[n]['chapter']}: {n.replace('_', ' ')}" for n in names],
           title="the book's claims against its records (blue: held, red: not)")  # fmt: skip
    ax.tick_params(axis="y", labelsize=7)
    ax.invert_yaxis()
    fig.tight_layout()
    save_figure(fig, args.out, path.with_suffix(".png").name)
    print(f"record: {path}")


if __name__ == "__main__":
    main()
