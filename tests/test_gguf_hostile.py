"""A GGUF file that is broken, lies about itself or asks for what is not built gives one
line naming the file and the key (exit status 2), never a traceback and never a model run
wrong; `tokenworks inspect` says the same key by key. The header is fuzzed with
hypothesis: every mutation either loads or is refused with ModelLoadError."""

from __future__ import annotations

import json

import gguf
import pytest
from gguf_files import FF, HIDDEN, VOCAB, write_small
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenworks.cli import main
from tokenworks.models.gguf_file import load_gguf
from tokenworks.models.loaded import ModelLoadError


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENWORKS_HOME", str(tmp_path / "home"))
    return tmp_path


def test_the_small_file_loads(home):
    spec = load_gguf(write_small(home / "ok.gguf")).spec
    assert (spec.n_layers, spec.hidden_size, spec.vocab_size) == (1, HIDDEN, VOCAB)


def _truncated(path):
    write_small(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 4096])


def _wrong_magic(path):
    write_small(path)
    data = path.read_bytes()
    path.write_bytes(b"GGML" + data[4:])


CASES = {
    "wrong magic": (_wrong_magic, "is not a readable GGUF file"),
    "truncated": (_truncated, "truncated"),
    "unknown architecture": (lambda p: write_small(p, arch="mamba"), "mamba"),
    "shape against metadata": (
        lambda p: write_small(p, shapes={"blk.0.ffn_up.weight": (FF + 16, HIDDEN)}),
        "tensor blk.0.ffn_up.weight has shape [32, 64], but the metadata "
        "(embedding_length, feed_forward_length) makes it [32, 48]",
    ),
    "a block past block_count": (
        lambda p: write_small(p, shapes={"blk.3.attn_norm.weight": (HIDDEN,)}),
        "tensor blk.3.attn_norm.weight is past block_count = 1",
    ),
    "an unread hyperparameter": (
        lambda p: write_small(p, keys={"{arch}.attn_logit_softcapping": 30.0}),
        "llama.attn_logit_softcapping = 30.0: a hyperparameter tokenworks does not read",
    ),
    "a value of the wrong kind": (
        lambda p: write_small(p, keys={"{arch}.attention.key_length": "wide"}),
        "llama.attention.key_length = 'wide' is not a int",
    ),
    "rope scaling not built": (
        lambda p: write_small(p, keys={"{arch}.rope.scaling.type": "longrope"}),
        "llama.rope.scaling.type = 'longrope' is not supported",
    ),
    "EOS appended to prompts": (
        lambda p: write_small(p, keys={"tokenizer.ggml.add_eos_token": 1}),
        "tokenizer.ggml.add_eos_token = 1: appending EOS to every prompt is not built",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_hostile_file_is_one_line_and_exit_2(case, home, capsys):
    make, says = CASES[case]
    path = home / "hostile.gguf"
    make(path)
    assert main(["generate", "hi", "--model", str(path), "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: {path}"), err
    assert says in err[-1], err[-1]
    assert "Traceback" not in "\n".join(err)


def test_inspect_says_what_each_key_gets_and_why_a_file_is_refused(home, capsys):
    path = write_small(home / "asks.gguf", keys={"{arch}.attn_logit_softcapping": 30.0,
                                                 "{arch}.rope.scaling.type": "linear",
                                                 "{arch}.rope.scaling.factor": 2.0})  # fmt: skip
    assert main(["inspect", str(path), "--json"]) == 2
    report = json.loads(capsys.readouterr().out)
    verdicts = {k["key"]: k["action"] for k in report["keys"]}
    assert verdicts["llama.rope.scaling.type"] == "read"
    assert verdicts["llama.attn_logit_softcapping"] == "refused"
    assert verdicts["general.architecture"] == "read"
    assert report["tensor_types"] == [{"type": "F32", "tensors": 11, "runs": "read as floats"}]
    assert not report["loads"] and "attn_logit_softcapping" in report["refused"]
    ok = write_small(home / "ok.gguf")
    assert main(["inspect", str(ok)]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("loads: n_layers 1")


def _header_end(path) -> int:
    """Where the metadata ends: the first tensor's data starts past it."""
    return min(int(t.data_offset) for t in gguf.GGUFReader(path).tensors)


@settings(max_examples=240, deadline=None, suppress_health_check=[HealthCheck.too_slow,
          HealthCheck.function_scoped_fixture])  # fmt: skip
@given(st.data())
def test_a_mutated_header_loads_or_is_refused_with_a_message(tmp_path_factory, data):
    base = tmp_path_factory.getbasetemp() / "fuzz"
    base.mkdir(exist_ok=True)
    clean = base / "clean.gguf"
    if not clean.exists():
        write_small(clean)
    raw = bytearray(clean.read_bytes())
    end = _header_end(clean)
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, end - 1))
        raw[at] = data.draw(st.integers(0, 255))
    path = base / "mutated.gguf"
    path.write_bytes(bytes(raw))
    try:
        load_gguf(path)
    except ModelLoadError as e:
        assert str(e).startswith(str(path)), e
