"""`tokenworks bench structured`: what structured output costs in decode throughput.

The same prompts decode with and without a JSON-schema constraint (llguidance masks in the
sampler), in the same run, in the order A B, B A, A B, ... over the repeats (the machine's
speed drifts); the medians are compared. Decode throughput is read from
the engine's own step records: tokens over seconds of the decode-only steps that ran the
full batch (so a constrained sequence that finishes early does not shift the batch size).
The bar: the constraint may cost at most 20% of decode throughput.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from tokenworks.bench.record import make_record, model_record, write_record
from tokenworks.config import engine_kwargs

# An open-ended list keeps the grammar busy for many tokens: objects, strings, numbers.
SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "city": {"type": "string", "maxLength": 24},
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        },
        "required": ["name", "age", "city", "tags"],
    },
}


def _decode_rate(stats, batch: int) -> dict:
    steps = [s for s in stats if s.prefill_tokens == 0 and s.batch_size == batch]
    seconds = sum(s.duration_s for s in steps)
    tokens = sum(s.decode_tokens for s in steps)
    return {
        "decode_tok_s": tokens / seconds if seconds else None,
        "decode_steps": len(steps),
        "mean_step_ms": 1000 * seconds / len(steps) if steps else None,
    }


def run_structured(args) -> Path:
    from tokenworks import LLM, SamplingParams
    from tokenworks.engine.request import StructuredOutput

    threads = args.threads or 2
    llm = LLM(args.model, **{**engine_kwargs(args), "threads": threads})
    engine = llm.engine
    constraint = StructuredOutput.json(SCHEMA)
    engine.grammars.compile(constraint)  # build the llguidance tokenizer outside the timing
    results = {}
    for batch in args.batch_sizes:
        prompts = [
            llm.render_chat(
                [{"role": "user", "content": f"List {10 + i} people as JSON: name, age, city."}]
            )
            for i in range(batch)
        ]
        runs = {"plain": [], "json_schema": []}
        pair = [("plain", None), ("json_schema", constraint)]
        for rep in range(args.repeats):
            for name, structured in pair if rep % 2 == 0 else pair[::-1]:  # A B, B A, ...
                params = SamplingParams(
                    max_tokens=args.output_tokens,
                    temperature=0,
                    ignore_eos=True,
                    structured=structured,
                )
                engine.stats.clear()
                t = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                rate = _decode_rate(engine.stats, batch)
                rate["elapsed_s"] = time.perf_counter() - t
                rate["output_tokens"] = sum(len(o.outputs[0].token_ids) for o in outs)
                if structured is not None:
                    rate["example"] = outs[0].outputs[0].text[:200]
                runs[name].append(rate)
        plain = statistics.median(r["decode_tok_s"] for r in runs["plain"])
        constrained = statistics.median(
            r["decode_tok_s"] for r in runs["json_schema"] if r["decode_tok_s"]
        )
        cost = 1 - constrained / plain
        results[str(batch)] = {
            "plain_decode_tok_s": plain,
            "json_schema_decode_tok_s": constrained,
            "ratio_json_schema_to_plain": constrained / plain,
            "cost_fraction": cost,
            "meets_20pct_bar": cost <= 0.20,
            "runs": runs,
        }
        print(
            f"batch {batch}: plain {plain:.1f} tok/s, json_schema {constrained:.1f} tok/s, "
            f"cost {100 * cost:.1f}%"
        )
    record = make_record(
        kind="structured_output_cost",
        engine=llm.config.to_dict(),
        model=model_record(llm),
        workload={
            "batch_sizes": args.batch_sizes,
            "output_tokens": args.output_tokens,
            "repeats": args.repeats,
            "threads": threads,
            "schema": SCHEMA,
            "sampling": "greedy, EOS ignored (the grammar still ends a finished list)",
            "measure": "decode-only steps at full batch, from engine step records",
        },
        results=results,
        seeds=[],
        peers={},
    )
    path = write_record(record, args.out)
    print(
        json.dumps(
            {b: {k: v for k, v in r.items() if k != "runs"} for b, r in results.items()}, indent=2
        )
    )
    print(f"record: {path}")
    return path
