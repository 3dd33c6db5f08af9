"""`tokenworks bench peers`: peer discovery, servers started as subprocesses, NOT_RUN for
what is missing, and the comparison report, on the real model (no peers are needed: the
missing ones must come out NOT_RUN, never as a figure)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tokenworks.bench.peer_engines import (
    PeerStartError,
    discover,
    running_server,
    tokenworks_server,
)
from tokenworks.cli import build_parser
from tokenworks.config import engine_argv


def _discover(peers_dir, hf_dir=None):
    return discover(
        peers_dir,
        gguf="/models/x.gguf",
        hf_dir=hf_dir or str(Path(peers_dir) / "smol-hf"),
        served_model="model",
        threads=2,
        max_num_seqs=8,
        context_per_seq=512,
    )


def test_discovery_says_why_each_missing_peer_cannot_run(tmp_path):
    peers = _discover(tmp_path)
    assert set(peers) == {"transformers", "llama.cpp", "vllm", "sglang"}
    assert "vLLM is not installed" in peers["vllm"].reason
    assert "llama.cpp is not installed" in peers["llama.cpp"].reason
    assert "AMX" in peers["sglang"].reason
    # transformers runs in-process from this Python (the dev extra has it), with no server
    assert peers["transformers"].runs and peers["transformers"].python == sys.executable
    assert peers["transformers"].server is None and peers["transformers"].no_server


def test_discovery_finds_installed_peers_and_builds_their_servers(tmp_path):
    for sub in ("vllm", "llamacpp"):
        (tmp_path / sub / "bin").mkdir(parents=True)
        (tmp_path / sub / "bin" / "python").touch()
    peers = _discover(tmp_path)
    # vLLM without the HF copy of the weights cannot run: said so, not attempted
    assert "Hugging Face copy" in peers["vllm"].reason
    (tmp_path / "smol-hf").mkdir()
    (tmp_path / "smol-hf" / "config.json").write_text("{}")
    (tmp_path / "llamacpp" / "bin" / "llama-server").touch()
    peers = _discover(tmp_path)
    vllm = peers["vllm"]
    assert vllm.runs and vllm.server[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert vllm.server_env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    lc = peers["llama.cpp"]
    assert lc.runs and lc.server[0].endswith("llama-server")
    assert lc.server[lc.server.index("-np") + 1] == "8"
    assert lc.server[lc.server.index("-c") + 1] == str(8 * 512)  # the slots share -c


@pytest.mark.parametrize(
    "argv", [["bench", "peers", "--offline-rounds", "0"], ["bench", "throughput", "--rounds", "-1"]]
)
def test_fewer_than_one_round_is_refused_with_a_reason(argv, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    assert "every engine runs at least once" in capsys.readouterr().err


def test_a_record_takes_each_engines_details_from_its_median_round():
    from tokenworks.bench.throughput import median_round

    assert median_round([700.0, 562.0, 744.0]) == 0
    assert median_round([944.0, 1011.0, 731.0]) == 0
    assert median_round([5.0]) == 0
    assert median_round([3.0, 1.0, 4.0, 2.0]) == 3  # even: the lower of the middle two


def test_engine_flags_round_trip_to_a_serve_command_line():
    args = build_parser().parse_args(
        ["bench", "peers", "--threads", "2", "--max-num-seqs", "16", "--no-prefix-caching"]
    )
    argv = engine_argv(args)
    assert argv == ["--threads", "2", "--no-prefix-caching", "--max-num-seqs", "16"]
    again = build_parser().parse_args(["serve", *argv])
    assert again.threads == 2 and again.max_num_seqs == 16 and not again.enable_prefix_caching


def test_a_server_that_exits_at_once_is_a_clear_start_error(tmp_path):
    argv = [sys.executable, "-c", "import sys; print('bad flag'); sys.exit(3)"]
    with pytest.raises(PeerStartError, match="exited with 3: bad flag"):
        with running_server(argv, {}, tmp_path / "log.txt", timeout_s=30):
            pass


def test_our_server_runs_as_a_subprocess_and_is_stopped(tmp_path):
    argv = tokenworks_server(["--model", "toy", "--dtype", "float32"], "model")
    with running_server(argv, {}, tmp_path / "serve.log", timeout_s=120) as url:
        models = httpx.get(url + "/v1/models").json()
        assert "model" in [m["id"] for m in models["data"]]
    with pytest.raises(httpx.HTTPError):
        httpx.get(url + "/v1/models", timeout=2)


def test_bench_peers_measures_ours_and_records_missing_peers_as_not_run(smol_loaded, tmp_path):
    small = {
        "kind": "random",
        "num_requests": 3,
        "seed": 0,
        "input": {"dist": "fixed", "value": 12},
        "output": {"dist": "fixed", "value": 4},
        "ignore_eos": True,
    }
    manifest = tmp_path / "small.json"
    manifest.write_text(json.dumps(small))
    out, report = tmp_path / "results", tmp_path / "report"
    cmd = [
        sys.executable,
        "-c",
        "import sys; from tokenworks.cli import main; sys.exit(main())",
        *("bench", "peers", "--peers-dir", str(tmp_path / "no-peers"), "--only", "vllm,sglang"),
        *("--threads", "2", "--max-num-seqs", "4", "--kv-cache-memory", "0.25"),
        *("--prompt-tokens", "16", "--decode-tokens", "4", "--repeats", "1"),
        *("--offline-manifest", str(manifest), "--serving-manifest", str(manifest)),
        *("--offline-rounds", "2", "--request-rate", "20", "--max-concurrency", "2"),
        *("--out", str(out), "--report", str(report)),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]

    latency = json.loads(next(out.glob("latency-*.json")).read_text())
    assert latency["results"]["summary_median"]["tokenworks"]["decode_tok_s"] > 0
    assert latency["peers"]["vllm"]["status"] == "NOT_RUN"
    assert "vllm" not in latency["results"]["summary_median"]  # no figure for it
    offline = json.loads(next(out.glob("throughput-*.json")).read_text())
    assert offline["results"]["tokenworks"]["output_tokens"] == 3 * 4
    assert offline["workload"]["manifest"]["num_requests"] == 3
    rounds = offline["results"]["tokenworks"]["rounds"]  # each a measurement of its own
    assert offline["workload"]["manifest"]["rounds"] == 2 and len(rounds) == 2
    assert all(x["output_tokens"] == 12 and x["elapsed_s"] > 0 for x in rounds)
    assert offline["results"]["ratio_per_round"] == {}  # no peer ran
    serving = [json.loads(p.read_text()) for p in sorted(out.glob("serving-*.json"))]
    ours = [s for s in serving if s.get("status") != "NOT_RUN"]
    missing = [s for s in serving if s.get("status") == "NOT_RUN"]
    assert len(ours) == 1 and {s["engine"]["engine"] for s in missing} == {"vllm", "sglang"}
    assert all(s["results"] == {} for s in missing)
    assert ours[0]["engine"]["server_argv"][3] == "serve"
    for run in ours[0]["results"]["runs"]:
        assert run["figures"]["completed"] == 3 and run["figures"]["output_tokens"] == 12
    # every engine ran the very same workload
    assert len({s["workload"]["sha256"] for s in serving}) == 1

    text = (report / "peers.md").read_text()
    assert text.startswith("# tokenworks and its peers")
    assert "## Single-stream latency" in text and "## Offline throughput" in text
    assert "| vllm | NOT_RUN |" in text and "## Not run here" in text
    assert "Each engine ran 2 times, in turn" in text  # and every round's figure
    assert "(1.00x)" in text  # ours in the serving comparison
    assert (report / "peers-serving.png").read_bytes()[:4] == b"\x89PNG"
    for link in ("../results/latency-", "../results/throughput-", "../results/serving-"):
        assert link in text
