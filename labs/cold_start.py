"""Lab: what the first request pays that the second does not.

A fresh process is stamped at each boundary as it starts serving: Python and tokenworks
imported; the model loaded and the engine built (the file's index read, the weights
mapped, the KV pool laid out, the C kernels built or found in their cache, and where it
runs, a warm-up pass); the first request (a prompt of about 50 tokens and 8 generated);
then a second request, a different prompt of the same length. Three ways:

- default: the engine as `LLM(model)` builds it (batch-invariant on the C kernels, where
  every batch runs as whole-step rows, which the warm-up has nothing to build for);
- fastest: `batch_invariant=False`, each batch size on its fastest products, with the
  warm-up pass those products' first big step is spared by;
- fastest, no warm-up: the same without it, so the first request pays whatever is left.

Each model runs in R fresh processes each way; the figures are medians.

    python labs/cold_start.py [--models smollm2-135m,gemma3-270m,...] [--runs 3]

Writes an evidence record and a PNG (seconds per stage, per model and way).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tqdm import tqdm  # noqa: E402

from tokenworks.bench.labs import parse_lab_args, save_figure  # noqa: E402
from tokenworks.bench.record import make_record, write_record  # noqa: E402

# two different prompts of about the same length (no prefix is shared), each answered with
# GENERATE tokens: the first request runs prefill and decode for the first time
PROMPTS = (
    "Once upon a time, there was a little robot who lived in a workshop full of old clocks. "
    "Every morning it wound each clock, listened to the ticking, and wrote down which ones "
    "ran fast and which ran slow. One day a clock stopped, and the robot",
    "In a small town by the sea, there lived a baker who woke before the gulls. She mixed "
    "flour and water by lamplight, shaped the loaves with floury hands, and watched the "
    "harbour through the window while the oven warmed. That morning a ship",
)
GENERATE = 8

# the child: stamps at each boundary, then its peak resident set
_CHILD = """
import json, sys, time
spawned = float(sys.argv[1])
t = {"spawned": spawned}
import torch
t["python"] = time.time()
from tokenworks import LLM, SamplingParams
t["imported"] = time.time()
llm = LLM(sys.argv[2], threads=int(sys.argv[4]), **json.loads(sys.argv[3]))
t["loaded"] = time.time()
one = SamplingParams(max_tokens=int(sys.argv[6]), temperature=0, ignore_eos=True)
for i, prompt in enumerate(json.loads(sys.argv[5])):
    llm.generate([prompt], one, use_tqdm=False)
    t[f"request_{i + 1}"] = time.time()
hwm = next(int(x.split()[1]) * 1024 for x in open("/proc/self/status") if x.startswith("VmHWM"))
print("RESULT " + json.dumps({"stamps": t, "peak_rss_bytes": hwm,
                              "kernels": llm.engine.kernels()}))
"""

STAGES = {  # key -> what it holds
    "python_torch": "start Python + torch",
    "import": "import tokenworks",
    "load_build": "load + build",
    "first_request": "first request",
    "second_request": "second request",
}


WAYS = {  # name -> the LLM options that make it
    "default": {},
    "fastest": {"batch_invariant": False},
    "fastest_no_warmup": {"batch_invariant": False, "warmup": False},
}


def one_process(model: str, options: dict, threads: int) -> dict:
    """A fresh process's stage seconds (STAGES), its peak RSS and kernels."""
    spawned = time.time()
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(spawned), model, json.dumps(options), str(threads),
         json.dumps(PROMPTS), str(GENERATE)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{model}: the child failed:\n{done.stderr[-2000:]}")
    got = json.loads(line[len("RESULT ") :])
    s = got["stamps"]
    marks = [s["spawned"], s["python"], s["imported"], s["loaded"], s["request_1"], s["request_2"]]
    seconds = [b - a for a, b in zip(marks, marks[1:], strict=False)]
    return {
        "seconds": dict(zip(STAGES, seconds, strict=True)),
        "peak_rss_bytes": got["peak_rss_bytes"],
        "kernels": got["kernels"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b,"
                    "qwen2.5-coder-1.5b")  # fmt: skip
    ap.add_argument("--runs", type=int, default=3, help="fresh processes per model and way")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results")
    args = parse_lab_args(ap, fast=dict(models="smollm2-135m", runs=1))
    models = args.models.split(",")

    rows: dict = {m: {} for m in models}  # model -> way -> figures
    jobs = [(m, w) for m in models for w in WAYS]
    for model, way in tqdm(jobs, desc="fresh processes", unit="model"):
        runs = [one_process(model, WAYS[way], args.threads) for _ in range(args.runs)]
        median = {k: statistics.median(r["seconds"][k] for r in runs) for k in STAGES}
        r = rows[model][way] = {
            "median_seconds": median,
            "first_over_second": median["first_request"] / median["second_request"],
            "to_first_answer_s": sum(median[k] for k in list(STAGES)[:4]),
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in runs),
            "kernels": runs[0]["kernels"],
            "runs": runs,
        }
        print(f"{model:20s} {way:17s}: "
              + ", ".join(f"{STAGES[k]} {v:.2f} s" for k, v in median.items())
              + f"; first/second {r['first_over_second']:.1f}x")  # fmt: skip

    record = make_record(
        kind="lab.cold_start",
        engine={"threads": args.threads, "ways": WAYS},
        model={"ids": models},
        workload={"prompts": PROMPTS, "max_tokens": GENERATE, "runs": args.runs},
        results={"rows": rows, "stages": STAGES},
        seeds=[],
    )
    path = write_record(record, args.out)

    bars = [(f"{m}, {w.replace('_', ' ')}", r) for m, ways in rows.items() for w, r in ways.items()]
    bars.reverse()
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(bars) + 1.5))
    left = [0.0] * len(bars)
    colours = ("#bbbbbb", "#88ccee", "#4477aa", "#cc6677", "#ddcc77")
    for (stage, label), colour in zip(STAGES.items(), colours, strict=True):
        widths = [r["median_seconds"][stage] for _, r in bars]
        ax.barh([n for n, _ in bars], widths, left=left, color=colour, label=label)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.set(xlabel="seconds from spawning the process (medians)",
           title="a fresh process: where the time to the first and second answer goes")  # fmt: skip
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    save_figure(fig, args.out, path.with_suffix(".png").name)
    print(f"record: {path}")


if __name__ == "__main__":
    main()
