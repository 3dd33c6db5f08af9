"""`tokenworks bench long-context`: the five claims a context length makes, measured.

A model that "has a 32K context" claims five things, and each is measured apart:

1. accepts: admission takes a prompt of context - 1 tokens and refuses one of context
   tokens, naming the limit (engine/admission.py);
2. behaves: the loss at each position of a long English text (Jane Austen's *Lady Susan*,
   from the `music21` package, or --text), in buckets of position;
3. fits: the KV bytes one sequence holds against its context, measured in the pool beside
   `plan kv`; with --window-model, a windowed model (Gemma 3) with its windows giving
   blocks back and with them only masking, on the same workload;
4. answers in time: prefill (chunked) and decode time against the context length;
5. uses what it is given: a needle (a number in a sentence) put at a depth of a haystack
   of the text, and the model asked for it at the end; right when the number comes back.

Every trial computes its whole prompt (prefix caching off), so its times are its own.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import time
from pathlib import Path

from tqdm import tqdm

from tokenworks.bench.record import make_record, model_record, write_record
from tokenworks.config import engine_kwargs
from tokenworks.engine.loop import EngineLoop, LocalInbox

NEEDLE = "\nThe secret number of Churchhill castle is {number}.\n"
QUESTION = (
    "\n\nQuestion: What is the secret number of Churchhill castle?\n"
    "Answer: The secret number of Churchhill castle is"
)
ANSWER_TOKENS = 8


def english_text(path: str | None = None) -> str:
    """The long text: a file given, else Lady Susan as `music21` ships it."""
    if path:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    try:
        import importlib.resources

        source = importlib.resources.files("music21") / "languageExcerpts/trainingData/en.txt"
        return source.read_text(encoding="utf-8", errors="replace")
    except (ModuleNotFoundError, FileNotFoundError) as e:
        raise SystemExit(
            f"no long text: {e}; `pip install 'tokenworks[bench]'` (music21 ships Lady "
            "Susan) or give --text"
        ) from None


# ---------------------------------------------------------------------- 1. accepts


def accepts(engine) -> dict:
    """What admission says at the edge of the context."""
    adm, ctx = engine.admission, engine.max_model_len
    inside = adm.check_lengths(ctx - 1, 1)
    at = adm.check_lengths(ctx, 1)
    return {
        "context": ctx,
        "context_source": adm.context_source,
        "accepts_prompt_of": ctx - 1 if inside is None else None,
        "refusal_at_context": None if at is None else {"limit": at.limit, "reason": at.reason},
    }


# ---------------------------------------------------------------------- 2. behaves


def loss_by_position(engine, ids: list[int], chunk: int = 512, buckets: int = 16) -> dict:
    """Negative log-likelihood of each next token of ids, fed in chunks through a paged pool
    of its own (torch's modules), averaged over position buckets of equal size."""
    import torch

    from tokenworks.engine.kv_pool import KVPool
    from tokenworks.ops.attention import AttentionMetadata

    n, bs = len(ids), engine.config.block_size
    pool = KVPool.for_spec(engine.spec, -(-n // bs), bs, engine.config.torch_dtype)
    table = list(range(pool.num_blocks))
    nll = torch.empty(n - 1, dtype=torch.float64)
    tokens = torch.tensor(ids)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for start in tqdm(range(0, n - 1, chunk), desc="loss by position"):
            stop = min(start + chunk, n - 1)
            meta = AttentionMetadata.paged([stop - start], [start], [table], bs)
            logits = engine.model(tokens[start:stop], torch.arange(start, stop), meta, pool)
            logp = torch.log_softmax(logits.float(), dim=-1)
            nll[start:stop] = -logp.gather(1, tokens[start + 1 : stop + 1, None])[:, 0].double()
    seconds = time.perf_counter() - t0
    edges = [round(i * (n - 1) / buckets) for i in range(buckets + 1)]
    rows = []
    for lo, hi in zip(edges, edges[1:], strict=False):
        mean = float(nll[lo:hi].mean())
        rows.append({"from": lo, "to": hi, "nll": mean, "ppl": float(torch.tensor(mean).exp())})
    return {"tokens": n, "chunk": chunk, "seconds": seconds, "buckets": rows,
            "nll_all": float(nll.mean())}  # fmt: skip


# ---------------------------------------------------------------------- 4 and 5


def haystack(tok, text_ids: list[int], length: int, depth: float, number: int) -> list[int]:
    """length tokens: the text (again from its start where it is shorter), the needle at
    `depth` of it (after a full stop where one is near), the question at the end."""
    needle = tok.encode(NEEDLE.format(number=number), add_special_tokens=False)
    question = tok.encode(QUESTION, add_special_tokens=False)
    room = length - len(needle) - len(question)
    if room < 1:
        raise ValueError(f"a {length}-token haystack leaves no room for text")
    filler = (text_ids * -(-room // len(text_ids)))[:room]
    at = int(depth * room)
    for back in range(min(at, 64)):
        if tok.decode([filler[at - back - 1]]).rstrip().endswith("."):
            at -= back
            break
    return filler[:at] + needle + filler[at:] + question


def run_trial(loop: EngineLoop, prompt: list[int], number: int, tok) -> dict:
    """One needle trial alone in the engine: the answer and its times."""
    from tokenworks import SamplingParams

    engine = loop.engine
    engine.stats.clear()
    seq = loop.add_request(prompt, SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0))
    held = None
    for _ in loop.turns(LocalInbox(), engine.has_unfinished):
        if held is None and seq.n_cached >= len(prompt):  # the prompt is in
            held = engine.kv_bytes_held(seq), seq.n_cached
    stats = list(engine.stats)
    prefill = [s for s in stats if s.prefill_tokens]
    decode = [s for s in stats if not s.prefill_tokens]
    answer = tok.decode(seq.output_ids)
    return {
        "prompt_tokens": len(prompt),
        "number": number,
        "answer": answer,
        "correct": str(number) in answer,
        "prefill_s": sum(s.duration_s for s in prefill),
        "prefill_steps": len(prefill),
        "decode_s_per_token": (sum(s.duration_s for s in decode) / len(decode) if decode else None),
        "kv_bytes_held": held[0],  # once the prompt is in the cache
        "kv_tokens": held[1],
    }


def needles(loop: EngineLoop, tok, text_ids, lengths, depths, seed: int) -> list[dict]:
    rng = random.Random(seed)
    trials = [(length, depth) for length in lengths for depth in depths]
    out = []
    for length, depth in tqdm(trials, desc="needles"):
        number = rng.randrange(10_000, 100_000)
        prompt = haystack(tok, text_ids, length, depth, number)
        out.append({"length": length, "depth": depth} | run_trial(loop, prompt, number, tok))
    return out


# ---------------------------------------------------------------------- 3. fits


def planned_kv(spec, contexts, dtype: str, block_size: int) -> list[dict]:
    """plan kv's figures for a model at each context: by token, and in a paged pool's whole
    blocks with windows giving blocks back."""
    from tokenworks.shapes import kv_bytes

    shape, kv = spec.shape, {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}[dtype]
    unwindowed = dataclasses.replace(shape, sliding_window=None)
    return [
        {
            "context": c,
            "plan_bytes": kv_bytes(shape, c, kv),
            "plan_paged_bytes": kv_bytes(shape, c, kv, block_size=block_size),
            "plan_unwindowed_bytes": kv_bytes(unwindowed, c, kv, block_size=block_size),
        }
        for c in contexts
    ]


def window_memory(model: str, args, lengths: list[int], concurrent: int, seed: int) -> dict:
    """A windowed model on one workload, its windows giving blocks back and only masking:
    the KV bytes one sequence holds once its prompt is in, at each length; and the most
    bytes in use while `concurrent` sequences of the longest length run together."""
    from tokenworks import LLM, SamplingParams

    out = {"model": model, "lengths": lengths, "concurrent": concurrent}
    rng = random.Random(seed)
    for kv in ("free", "mask"):
        kwargs = engine_kwargs(args) | {
            "sliding_window_kv": kv, "enable_prefix_caching": False,
            "threads": args.threads or 2,
        }  # fmt: skip
        llm = LLM(model, **kwargs)
        engine, loop = llm.engine, llm.loop
        vocab = engine.spec.vocab_size
        per_length = []
        for length in tqdm(lengths, desc=f"{model} windows {kv}"):
            prompt = [rng.randrange(3, vocab) for _ in range(length)]
            seq = loop.add_request(
                prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
            )
            held = None
            for _ in loop.turns(LocalInbox(), lambda seq=seq: not seq.finished):
                if held is None and seq.n_cached >= length:  # the prompt is in
                    held = engine.kv_bytes_held(seq)
            per_length.append({"context": length, "kv_bytes_held": held})
        engine.stats.clear()
        longest = max(lengths)
        params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        for _ in range(concurrent):
            loop.add_request([rng.randrange(3, vocab) for _ in range(longest)], params)
        loop.run_while(engine.has_unfinished)
        peak = max(s.kv_bytes_in_use for s in engine.stats)
        out[kv] = {
            "per_sequence": per_length,
            "peak_bytes_in_use": peak,
            "layout": engine.kv_layout.describe(),
            "pool_bytes": engine.pool.nbytes,
        }
        out["plan"] = planned_kv(engine.spec, lengths, llm.config.resolved_dtype,
                                 llm.config.block_size)  # fmt: skip
        out["engine"] = llm.config.to_dict() | {"sliding_window_kv": "free|mask"}
        del llm, engine
    return out


# ---------------------------------------------------------------------- the run


def run_long_context(args) -> Path:
    from tokenworks import LLM

    lengths = list(args.lengths)
    depths = list(args.depths)
    kwargs = engine_kwargs(args) | {"enable_prefix_caching": False, "threads": args.threads or 2}
    llm = LLM(args.model, **kwargs)
    engine, tok = llm.engine, llm.tokenizer
    text_ids = tok.encode(english_text(args.text), add_special_tokens=False)
    too_long = [n for n in lengths if n >= engine.max_model_len]
    if too_long:
        raise SystemExit(f"lengths {too_long} leave no room in the context {engine.max_model_len}")
    results = {"accepts": accepts(engine)}
    ppl_tokens = min(args.ppl_tokens or engine.max_model_len, len(text_ids), engine.max_model_len)
    results["behaves"] = loss_by_position(engine, text_ids[:ppl_tokens])
    trials = needles(llm.loop, tok, text_ids, lengths, depths, args.seed)
    results["needles"] = trials
    results["fits"] = planned_kv(engine.spec, lengths, llm.config.resolved_dtype,
                                 llm.config.block_size)  # fmt: skip
    for row in results["fits"]:  # a prompt of `length` tokens once it is in the cache
        row["measured_bytes"] = next(
            t["kv_bytes_held"] for t in trials if t["kv_tokens"] == row["context"]
        )
    model = model_record(llm)
    config = llm.config.to_dict()
    del llm, engine
    if args.window_model:
        results["windows"] = window_memory(
            args.window_model, args, [n for n in lengths if n <= args.window_max], 4, args.seed
        )
    results["summary"] = summary(results)
    record = make_record(
        kind="long-context",
        engine=config,
        model=model,
        workload={
            "lengths": lengths,
            "depths": depths,
            "needle": NEEDLE,
            "question": QUESTION,
            "answer_tokens": ANSWER_TOKENS,
            "text": args.text or "music21 languageExcerpts/trainingData/en.txt (Lady Susan)",
            "text_tokens": len(text_ids),
            "ppl_tokens": ppl_tokens,
            "window_model": args.window_model,
            "window_max": args.window_max,
            "sampling": "greedy",
            "prefix_caching": False,
        },
        results=results,
        seeds=[args.seed],
    )
    path = write_record(record, args.out)
    plot(record, path.with_suffix(".png"))
    print(json.dumps(results["summary"], indent=2))
    print(f"record: {path}")
    return path


def summary(results: dict) -> dict:
    """The figures a reader looks at first."""
    by_length: dict[int, list] = {}
    for t in results["needles"]:
        by_length.setdefault(t["length"], []).append(t)
    out = {
        "context": results["accepts"]["context"],
        "ppl": math.exp(results["behaves"]["nll_all"]),
        "ppl_first_bucket": results["behaves"]["buckets"][0]["ppl"],
        "ppl_last_bucket": results["behaves"]["buckets"][-1]["ppl"],
        "needle_accuracy": {
            n: sum(t["correct"] for t in ts) / len(ts) for n, ts in by_length.items()
        },
        "prefill_s": {n: ts[0]["prefill_s"] for n, ts in by_length.items()},
        "decode_ms_per_token": {
            n: 1e3 * ts[0]["decode_s_per_token"]
            for n, ts in by_length.items()
            if ts[0]["decode_s_per_token"]
        },
    }
    if "windows" in results:
        w = results["windows"]
        out["window_peak_bytes"] = {kv: w[kv]["peak_bytes_in_use"] for kv in ("free", "mask")}
        out["window_peak_ratio"] = w["mask"]["peak_bytes_in_use"] / w["free"]["peak_bytes_in_use"]
    return out


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = record["results"]
    fig, ax = plt.subplots(2, 2, figsize=(12, 9))
    name = record["model"]["id"]
    b = r["behaves"]["buckets"]
    ax[0, 0].plot([(x["from"] + x["to"]) / 2 for x in b], [x["ppl"] for x in b], "o-")
    ax[0, 0].set(xlabel="position in the text", ylabel="perplexity",
                 title=f"{name}: behaves (perplexity by position)")  # fmt: skip
    fits = r["fits"]
    mib = 2**20
    ax[0, 1].plot([f["context"] for f in fits], [f["plan_paged_bytes"] / mib for f in fits],
                  "k--", label=f"{name}: plan")  # fmt: skip
    ax[0, 1].plot(
        [f["context"] for f in fits],
        [(f["measured_bytes"] or 0) / mib for f in fits],
        "o",
        label=f"{name}: pool",
    )
    if "windows" in r:
        w = r["windows"]
        ctx = [p["context"] for p in w["plan"]]
        ax[0, 1].plot(ctx, [p["plan_paged_bytes"] / mib for p in w["plan"]], "g--",
                      label=f"{w['model']}: plan, windows free")  # fmt: skip
        ax[0, 1].plot(ctx, [p["plan_unwindowed_bytes"] / mib for p in w["plan"]], "r--",
                      label=f"{w['model']}: plan, mask only")  # fmt: skip
        for kv, mark in (("free", "g^"), ("mask", "rv")):
            rows = w[kv]["per_sequence"]
            ax[0, 1].plot([x["context"] for x in rows], [x["kv_bytes_held"] / mib for x in rows],
                          mark, label=f"{w['model']}: pool, {kv}")  # fmt: skip
    ax[0, 1].set(xscale="log", yscale="log", xlabel="context (tokens)",
                 ylabel="KV per sequence (MiB)", title="fits")  # fmt: skip
    ax[0, 1].legend(fontsize=7)
    trials = r["needles"]
    lengths = sorted({t["length"] for t in trials})
    depths = sorted({t["depth"] for t in trials})
    first = [next(t for t in trials if t["length"] == n) for n in lengths]
    ax[1, 0].plot(lengths, [t["prefill_s"] for t in first], "o-", label="prefill (s)")
    decode = [1e3 * (t["decode_s_per_token"] or 0) for t in first]
    ax[1, 0].plot(lengths, decode, "s-", label="decode (ms/token)")
    ax[1, 0].set(xscale="log", yscale="log", xlabel="prompt tokens",
                 title="answers in time")  # fmt: skip
    ax[1, 0].legend()
    grid = [[next(t["correct"] for t in trials if t["length"] == n and t["depth"] == d)
             for n in lengths] for d in depths]  # fmt: skip
    ax[1, 1].imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    ax[1, 1].set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax[1, 1].set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    ax[1, 1].set(xlabel="haystack tokens", ylabel="needle depth",
                 title="uses what it is given (green: found)")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
