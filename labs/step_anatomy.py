"""Lab: where a decode step's time goes, by batch size and by design choice.

One engine step is split into the parts the runtime is made of, timed from inside the
running engine:

- schedule: the scheduler picks the batch and its blocks;
- in C: the time inside the C library's calls (the whole step, the products on a GGUF's
  blocks, what lies between torch's products);
- forward, Python and torch: the rest of the forward pass (laying the batch out, ctypes
  structs, torch's products and ops, the model's modules);
- sample: each row's next token, stop checks and the tokens' bookkeeping;
- other: the rest of the step (the step log, finished sequences, blocks freed).

Three designs of the same engine, on the same model and the same B sequences decoding:
the default (the C kernels run every batch as rows of their whole step: batch-invariant),
the fastest products for each batch size (`batch_invariant=False`: dot products for a
few rows, torch's or the packed products for more, C between them), and torch's modules
alone (`kernels="torch"`). Each figure is the median over S pure decode steps.

    python labs/step_anatomy.py [--model smollm2-135m] [--sizes 1,4,16,64] [--steps 12]

Writes an evidence record and a PNG (milliseconds per step, part by part).
"""

from __future__ import annotations

import argparse
import statistics
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tqdm import tqdm  # noqa: E402

from tokenworks import LLM, SamplingParams  # noqa: E402
from tokenworks.bench.labs import parse_lab_args, save_figure  # noqa: E402
from tokenworks.bench.record import make_record, model_record, write_record  # noqa: E402
from tokenworks.bench.workload import latency_prompt  # noqa: E402
from tokenworks.engine import engine as engine_module  # noqa: E402
from tokenworks.kernels.abi import SIGNATURES  # noqa: E402
from tokenworks.kernels.build import library  # noqa: E402
from tokenworks.models import load  # noqa: E402

DESIGNS = {  # name -> the LLM options that make it
    "c_whole_step": {},
    "c_fastest_products": {"batch_invariant": False},
    "torch_modules": {"kernels": "torch"},
}
PARTS = ("schedule", "in_c", "forward_python_torch", "sample", "other")
CONTEXT = 64  # prompt tokens of each decoding sequence


class Clock:
    """Seconds spent in wrapped calls, by part; a wrapped call nested in another is taken
    out of the outer one's part (the C calls inside the forward pass)."""

    def __init__(self):
        self.spent = dict.fromkeys(PARTS, 0.0)
        self._inner = 0.0  # time of nested calls under the call being timed

    def wrap(self, obj, name: str, part: str) -> None:
        fn = getattr(obj, name)

        def timed(*args, **kwargs):
            outer, self._inner = self._inner, 0.0
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                took = time.perf_counter() - t
                self.spent[part] += took - self._inner
                self._inner = outer + took

        setattr(obj, name, timed)


def anatomy(llm: LLM, batch: int, steps: int) -> dict:
    """Median milliseconds per part over `steps` pure decode steps of `batch` sequences."""
    engine, loop, clock = llm.engine, llm.loop, Clock()
    clock.wrap(engine.scheduler, "schedule", "schedule")
    clock.wrap(engine_module, "sample_all", "sample")  # (engine.py calls it by that name)
    clock.wrap(engine.runner, "start", "forward_python_torch")  # the batch laid out and run
    lib = library()
    originals = {name: getattr(lib, name) for name in SIGNATURES} if lib is not None else {}
    for name in originals:
        clock.wrap(lib, name, "in_c")
    vocab = engine.spec.vocab_size
    prompts = [latency_prompt(CONTEXT, vocab, seed=1000 * batch + i) for i in range(batch)]
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    for p in prompts:
        loop.add_request(p, params=params)
    rows = []
    try:
        while engine.has_unfinished():
            before = dict(clock.spent)
            t = time.perf_counter()
            loop.step()
            total = time.perf_counter() - t
            s = engine.stats[-1]
            if s.prefill_tokens == 0 and s.decode_tokens == batch and len(rows) < steps:
                got = {k: clock.spent[k] - before[k] for k in PARTS}
                got["other"] = total - sum(got.values())
                rows.append({k: 1000 * v for k, v in got.items()} | {"total": 1000 * total})
    finally:
        for name, fn in originals.items():
            setattr(lib, name, fn)
    return {k: statistics.median(r[k] for r in rows) for k in (*PARTS, "total")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--sizes", default="1,4,16,64", help="sequences decoding together")
    ap.add_argument("--steps", type=int, default=12, help="pure decode steps timed")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results")
    args = parse_lab_args(ap, fast=dict(sizes="1,4", steps=3))
    sizes = [int(s) for s in args.sizes.split(",")]

    loaded = load(args.model)
    results, engines, llm = {}, {}, None
    for design, options in tqdm(DESIGNS.items(), desc="designs", unit="design"):
        llm = LLM(args.model, loaded=loaded, threads=args.threads, max_num_seqs=max(sizes),
                  warmup=False, **options)  # fmt: skip
        engines[design] = llm.engine.kernels()
        results[design] = {}
        for b in sizes:
            got = anatomy(llm, b, args.steps)
            results[design][f"batch_{b}"] = got
            print(f"{design:20s} batch {b:3d}: {got['total']:8.2f} ms a step ("
                  + ", ".join(f"{k} {got[k]:.2f}" for k in PARTS) + ")")  # fmt: skip
    record = make_record(
        kind="lab.step_anatomy",
        engine={"designs": DESIGNS, "kernels": engines, "threads": args.threads},
        model=model_record(llm),
        workload={"sizes": sizes, "steps": args.steps, "context": CONTEXT},
        results={"designs": results, "parts": PARTS},
        seeds=[1000 * b + i for b in sizes for i in range(b)],
    )
    path = write_record(record, args.out)

    fig, axes = plt.subplots(1, len(DESIGNS), figsize=(4 * len(DESIGNS), 4), sharey=True)
    colours = ("#bbbbbb", "#4477aa", "#88ccee", "#cc6677", "#ddcc77")
    for ax, (design, by_size) in zip(axes, results.items(), strict=True):
        bottom = [0.0] * len(sizes)
        labels = [str(b) for b in sizes]
        for part, colour in zip(PARTS, colours, strict=True):
            heights = [by_size[f"batch_{b}"][part] for b in sizes]
            ax.bar(labels, heights, bottom=bottom, color=colour, label=part.replace("_", " "))
            bottom = [a + h for a, h in zip(bottom, heights, strict=True)]
        ax.set(title=design.replace("_", " "), xlabel="sequences decoding")
    axes[0].set_ylabel("milliseconds per step (median)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, args.out, path.with_suffix(".png").name)
    print(f"record: {path}")


if __name__ == "__main__":
    main()
