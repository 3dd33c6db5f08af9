"""`tokenworks bench load`: what it costs to load a model, in a fresh process, beside
llama.cpp on the same file.

For each model a new Python process loads it and generates one token: the seconds from
spawning the process to that token (cold-process time to first token: imports, the file's
index or metadata, mapping the weights, building the engine) and the process's peak
resident set (its VmHWM), then `--decode-tokens` more for the decode rate. Another
process reads only the metadata and tokenizer: the peak less its resident set is what the
weights cost (`weights_peak_over_file`; Python and torch take about 250 MB before any).
llama.cpp's `llama-completion` does the same on the same file (its wall time to one token
and its peak resident set), and `llama-bench` gives its decode rate.

`--synthetic-7b` adds a random-weight GGUF of Qwen2-7B's shapes in llama.cpp's Q4_K_M mix
(bench/synthetic.py, about 4.4 GB): a model of the size users run, which does not fit in
memory as floats on a 24 GiB machine, to show it loads and decodes in about its file's size.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

from tokenworks.bench import synthetic
from tokenworks.bench.record import make_record, write_record

PROMPT = "Once upon a time, there was a little"

_CHILD = """
import json, sys, time
spawned = float(sys.argv[1])
from tokenworks import LLM, SamplingParams
kw = json.loads(sys.argv[3])
llm = LLM(sys.argv[2], **kw)
ready = time.time()
one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
llm.generate([sys.argv[4]], one, use_tqdm=False)
first = time.time()
n = int(sys.argv[5])
t0 = time.perf_counter()
llm.generate([sys.argv[4]], SamplingParams(max_tokens=n + 1, temperature=0, ignore_eos=True),
             use_tqdm=False)
t1 = time.perf_counter()
llm.generate([sys.argv[4]], one, use_tqdm=False)
t2 = time.perf_counter()
hwm = next(int(x.split()[1]) * 1024 for x in open("/proc/self/status") if x.startswith("VmHWM"))
print("RESULT " + json.dumps({
    "ready_s": ready - spawned, "ttft_s": first - spawned, "peak_rss_bytes": hwm,
    "decode_tok_s": n / max((t1 - t0) - (t2 - t1), 1e-9),
    "quantization": llm.engine.quantization or "none", "kernels": llm.engine.kernels(),
}))
"""


# what a process holds that has read the model's metadata and tokenizer and no weights:
# the load's peak less this is what the weights cost
_TOKENIZER_CHILD = """
import gc, json, sys
from tokenworks.engine.host_memory import release_freed_memory
from tokenworks.kernels.build import library
from tokenworks.models import load
from tokenworks.tokenizer import TokenizerWrapper
library()
tok = TokenizerWrapper.from_loaded(load(sys.argv[1], weights=False))
gc.collect()
release_freed_memory()
rss = next(int(x.split()[1]) * 1024 for x in open("/proc/self/status") if x.startswith("VmRSS"))
print("RESULT " + json.dumps({"tokenizer_rss_bytes": rss}))
"""


def _run(argv: list[str]) -> tuple[float, str]:
    """(wall seconds, stdout+stderr) of a child process."""
    t0 = time.time()
    proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[0]} exited {proc.returncode}:\n{proc.stdout[-3000:]}")
    return time.time() - t0, proc.stdout


def _peak_rss(argv: list[str]) -> tuple[float, int | None]:
    """(wall seconds, peak RSS bytes) of a program, through GNU time where it is installed.
    (A child's own ru_maxrss starts from its parent's when it forks, so this process's
    wait4 would report at least its own size.)"""
    gnu_time = shutil.which("time")  # the program (the shell's builtin is not on the PATH)
    if gnu_time is None:
        return _run(argv)[0], None
    wall, out = _run([gnu_time, "-f", "PEAK_KB %M", *argv])
    kb = [line.split()[1] for line in out.splitlines() if line.startswith("PEAK_KB ")]
    return wall, int(kb[-1]) * 1024 if kb else None


def ours(model: str, engine_kw: dict, decode_tokens: int) -> dict:
    spawned = time.time()
    argv = [sys.executable, "-c", _CHILD, str(spawned), model, json.dumps(engine_kw), PROMPT,
            str(decode_tokens)]  # fmt: skip
    wall, out = _run(argv)
    row = _result(out) | {"wall_s": wall}
    row |= _result(_run([sys.executable, "-c", _TOKENIZER_CHILD, model])[1])
    row["weights_peak_bytes"] = row["peak_rss_bytes"] - row["tokenizer_rss_bytes"]
    return row


def _result(out: str) -> dict:
    line = next(x for x in out.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def llama_cpp(bin_dir: Path, path: str, threads: int, decode_tokens: int) -> dict:
    """llama-completion for one token (wall time, peak RSS), llama-bench for decode."""
    completion, bench = bin_dir / "llama-completion", bin_dir / "llama-bench"
    if not completion.exists() or not bench.exists():
        return {"status": "NOT_RUN", "reason": f"no llama-completion / llama-bench in {bin_dir} "
                "(benchmarks/peers.sh builds them)"}  # fmt: skip
    argv = [str(completion), "-m", path, "-p", PROMPT, "-n", "1", "-t", str(threads),
            "--no-warmup", "-no-cnv", "--temp", "0"]  # fmt: skip
    wall, peak = _peak_rss(argv)
    argv = [str(bench), "-m", path, "-t", str(threads), "-p", "0", "-n", str(decode_tokens),
            "-r", "2", "-o", "json"]  # fmt: skip
    _, out = _run(argv)
    rows = json.loads(out[out.index("[") :])
    return {"ttft_s": wall, "peak_rss_bytes": peak, "decode_tok_s": rows[0]["avg_ts"]}


def run_load(args) -> Path:
    from tokenworks.config import engine_kwargs
    from tokenworks.models import catalogue

    models = list(args.models)
    engine_kw = {k: v for k, v in engine_kwargs(args).items() if v is not None}
    engine_kw |= {"warmup": False, "threads": args.threads or 2}
    if args.synthetic_7b:
        models.append(str(synthetic.qwen2_7b_q4_k_m(str(catalogue.pull("smollm2-135m")))))
    bin_dir = Path(args.peers_dir) / "llamacpp" / "bin"
    results = {}
    for model in tqdm(models, desc="bench load", unit="model"):
        path = str(catalogue.pull(model)) if model in catalogue.CATALOGUE else model
        row = {"file": path, "file_bytes": Path(path).stat().st_size}
        row["tokenworks"] = ours(model, engine_kw, args.decode_tokens)
        row["llama.cpp"] = llama_cpp(bin_dir, path, engine_kw["threads"], args.decode_tokens)
        for engine in ("tokenworks", "llama.cpp"):
            r = row[engine]
            if r.get("peak_rss_bytes"):
                r["peak_rss_over_file"] = r["peak_rss_bytes"] / row["file_bytes"]
            if r.get("weights_peak_bytes"):
                r["weights_peak_over_file"] = r["weights_peak_bytes"] / row["file_bytes"]
        results[Path(path).name] = row
        print(_line(Path(path).name, row))
    record = make_record(
        kind="load",
        engine={k: v for k, v in engine_kw.items()},
        model={"models": models},
        workload={
            "prompt": PROMPT,
            "decode_tokens": args.decode_tokens,
            "synthetic_7b": synthetic.SHAPE if args.synthetic_7b else None,
            "cache": "page cache warm (the file read once before)",
        },  # fmt: skip
        results=results,
    )
    path = write_record(record, args.out)
    print(f"record: {path}")
    return path


def _line(name: str, row: dict) -> str:
    parts = [name]
    for engine in ("tokenworks", "llama.cpp"):
        r = row[engine]
        if "ttft_s" not in r:
            parts.append(f"{engine}: {r.get('reason', 'NOT_RUN')}")
            continue
        rss = "peak RSS not measured (no GNU time)"
        if r.get("peak_rss_bytes"):
            rss = (f"peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB "
                   f"({r['peak_rss_over_file']:.2f}x the file)")  # fmt: skip
        if r.get("weights_peak_over_file"):
            rss += f", the weights {r['weights_peak_over_file']:.2f}x"
        parts.append(
            f"{engine}: first token {r['ttft_s']:.1f} s, {rss}, "
            f"decode {r['decode_tok_s']:.1f} tok/s"
        )
    return " | ".join(parts)
