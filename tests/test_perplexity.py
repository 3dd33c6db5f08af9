"""`tokenworks eval perplexity`: the sliding-window perplexity transformers documents,
computed by transformers itself on the same weights, text and windows as the oracle."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tokenworks.eval.perplexity import perplexity, windows

TEXT = Path(__file__).parent / "data" / "held_out.txt"


def test_windows_score_each_token_once_with_context():
    """Overlapping windows score every token but the first once; windows that do not
    overlap cannot score their own first token (as in transformers' guide)."""
    for n, context, stride in [(10, 4, 4), (10, 4, 2), (11, 5, 3), (3, 8, 8), (9, 3, 1)]:
        scored = []
        for begin, end, k in windows(n, context, stride):
            assert end - begin <= context and 0 < k < end - begin
            scored += range(end - k, end)
        starts = range(stride, n, stride) if stride == context else ()
        assert scored == [i for i in range(1, n) if i not in starts], (n, context, stride)


def hf_perplexity(model, ids: list[int], context: int, stride: int) -> float:
    nll, count = 0.0, 0
    with torch.no_grad():
        for begin, end, k in windows(len(ids), context, stride):
            x = torch.tensor([ids[begin:end]])
            logp = torch.log_softmax(model(x).logits[0].double(), dim=-1)
            rows = torch.arange(end - begin - 1 - k, end - begin - 1)
            nll -= float(logp[rows, x[0, rows + 1]].sum())
            count += k
    return math.exp(nll / count)


@pytest.mark.parametrize("context,stride", [(128, 128), (128, 48)])
def test_perplexity_equals_transformers(smol_llm, hf_smol, context, stride):
    ids = smol_llm.tokenizer.encode(TEXT.read_text())[:400]
    ours = perplexity(smol_llm.engine, ids, context, stride)
    theirs = hf_perplexity(hf_smol, ids, context, stride)
    assert ours["tokens"] == sum(k for _, _, k in windows(len(ids), context, stride))
    assert abs(ours["perplexity"] / theirs - 1) < 0.005, (ours["perplexity"], theirs)


def test_the_command_writes_a_record(tmp_path, capsys):
    from tokenworks.cli import main

    argv = ["eval", "perplexity", str(TEXT), "--context", "64", "--max-tokens", "200",
            "--json", "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # 4 windows of 64 tokens, each scoring all but its first
    assert out["tokens"] == 196 and out["perplexity"] > 1 and math.isfinite(out["nll"])
    record = json.loads(Path(out["record"]).read_text())
    assert record["kind"] == "perplexity"
    assert record["model"]["quantization"] == "gguf"  # the default for a GGUF file
    assert record["results"]["perplexity"] == out["perplexity"]


def test_bad_input_is_an_error_that_says_what_to_fix(tmp_path, capsys):
    from tokenworks.cli import main

    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xf6\xff\x00")
    for argv, says in [
        (["eval", "perplexity", str(tmp_path / "missing.txt")], "cannot read it"),
        (["eval", "perplexity", str(binary)], "as UTF-8 text"),
        (["eval", "perplexity", str(TEXT), "--context", "1"], "at least 2 tokens"),
    ]:
        assert main(argv + ["--out", str(tmp_path)]) == 2
        assert says in capsys.readouterr().err
