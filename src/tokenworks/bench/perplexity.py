"""`tokenworks eval perplexity FILE`: eval/perplexity.py's figure for a model as the
engine options build it, printed and written as an evidence record."""

from __future__ import annotations

import json
from pathlib import Path

from tokenworks.bench.record import make_record, model_record, write_record
from tokenworks.config import engine_kwargs
from tokenworks.eval.perplexity import perplexity


def run(args) -> dict:
    """The figures, printed (one JSON object with --json), and the record."""
    from tokenworks import LLM

    try:
        text = Path(args.file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{args.file}: cannot read it as UTF-8 text ({e})") from None
    if args.context is not None and args.context < 2:
        raise ValueError(f"--context {args.context}: a window needs at least 2 tokens")
    llm = LLM(args.model, **engine_kwargs(args) | {"warmup": False})
    ids = llm.tokenizer.encode(text)
    if args.max_tokens:
        ids = ids[: args.max_tokens]
    result = perplexity(llm.engine, ids, args.context, args.stride)
    record = make_record(
        kind="perplexity",
        engine=llm.config.to_dict(),
        model=model_record(llm),
        workload={
            "file": str(args.file),
            "file_chars": len(text),
            "max_tokens": args.max_tokens,
            "context": result["context"],
            "stride": result["stride"],
            "method": "sliding window (transformers' perplexity guide)",
        },
        results=result,
    )
    path = write_record(record, args.out)
    if args.json:
        print(json.dumps(result | {"record": str(path)}))
    else:
        print(
            f"perplexity {result['perplexity']:.4f} over {result['tokens']} tokens "
            f"(nll {result['nll']:.5f}; context {result['context']}, stride {result['stride']}, "
            f"{result['windows']} windows, {result['seconds']:.1f} s)\nrecord: {path}"
        )
    return result
