"""The peer engines: where each is installed, how its OpenAI server starts, and, for one
that cannot run here, why (its records then say NOT_RUN with that reason).

Every peer lives in its own virtual environment under a peers directory (built by
benchmarks/peers.sh): `vllm/` (the CPU build, reading a
bfloat16 Hugging Face copy of the GGUF in `smol-hf/`), `llamacpp/` (llama-cpp-python; its
`llama-server` binary serves), `sglang/`; `transformers` runs from any Python that has it
(ours, by default). Our own server is started the same way as theirs, as a subprocess, so
the load generator never shares a process with the engine it measures.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path

PEER_NAMES = ("transformers", "llama.cpp", "vllm", "sglang")


class PeerStartError(RuntimeError):
    pass


@dataclass
class Peer:
    name: str
    label: str  # how reports name it
    python: str | None = None  # its own interpreter (latency / offline scripts)
    reason: str | None = None  # why it cannot run at all here (NOT_RUN), else None
    server: list[str] | None = None  # argv of its OpenAI-compatible server
    server_env: dict = field(default_factory=dict)
    no_server: str | None = None  # why it has no serving run, when server is None
    notes: str = ""

    @property
    def runs(self) -> bool:
        return self.reason is None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _venv_python(peers_dir: Path, sub: str) -> Path:
    return peers_dir / sub / "bin" / "python"


def discover(
    peers_dir: str | Path,
    *,
    gguf: str,
    hf_dir: str,
    served_model: str,
    threads: int,
    max_num_seqs: int,
    context_per_seq: int,
) -> dict[str, Peer]:
    """Each known peer, installed or not (a missing one carries its NOT_RUN reason)."""
    peers_dir = Path(peers_dir)
    hf = Path(hf_dir)
    out: dict[str, Peer] = {}

    # transformers: in-process from a Python that has it (no batching server of its own)
    tf_venv = _venv_python(peers_dir, "transformers")
    tf = Peer("transformers", "transformers (bf16)")
    if tf_venv.exists():
        tf.python = str(tf_venv)
    elif find_spec("transformers") and find_spec("gguf"):
        tf.python = sys.executable
    else:
        tf.reason = (
            f"transformers is not installed (no {tf_venv}, and this Python lacks it): "
            "pip install transformers gguf"
        )
    tf.no_server = "transformers runs in-process only (it has no batching OpenAI server here)"
    out["transformers"] = tf

    # llama.cpp: llama-cpp-python for in-process runs, llama-server (parallel slots) serving
    lc = Peer("llama.cpp", "llama.cpp (Q4_1 GGUF)")
    lc_python = _venv_python(peers_dir, "llamacpp")
    if lc_python.exists():
        lc.python = str(lc_python)
    server_bin = str(peers_dir / "llamacpp" / "bin" / "llama-server")
    if not Path(server_bin).exists():
        server_bin = shutil.which("llama-server") or server_bin
    if Path(server_bin).exists():
        lc.server = [
            server_bin,
            "-m",
            gguf,
            "--alias",
            served_model,
            "--host",
            "127.0.0.1",
            "-np",
            str(max_num_seqs),
            "-c",
            str(max_num_seqs * context_per_seq),  # shared by the slots
            "-t",
            str(threads),
            "-tb",
            str(threads),
            "--no-webui",
        ]
    else:
        lc.no_server = (
            f"no llama-server on the PATH or at {server_bin} (benchmarks/peers.sh builds it)"
        )
    if lc.python is None and lc.server is None:
        lc.reason = f"llama.cpp is not installed (no {lc_python}; see benchmarks/peers.sh)"
    out["llama.cpp"] = lc

    # vLLM's CPU build, reading the bfloat16 HF copy of the same weights
    vl = Peer("vllm", "vLLM CPU (bf16)")
    vl_python = _venv_python(peers_dir, "vllm")
    if not vl_python.exists():
        vl.reason = f"vLLM is not installed (no {vl_python}; see benchmarks/peers.sh)"
    elif not (hf / "config.json").exists():
        vl.reason = f"vLLM needs a Hugging Face copy of the model at {hf} (benchmarks/hf_copy.py)"
    else:
        vl.python = str(vl_python)
        vl.server_env = vllm_env(vl.python, threads)
        vl.server = [
            vl.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(hf),
            "--served-model-name",
            served_model,
            "--dtype",
            "bfloat16",
            "--host",
            "127.0.0.1",
            "--max-num-seqs",
            str(max_num_seqs),
        ]
    out["vllm"] = vl

    # SGLang: its CPU backend needs Intel AMX
    sg = Peer("sglang", "SGLang")
    sg_python = _venv_python(peers_dir, "sglang")
    if "amx_tile" not in cpu_flags():
        sg.reason = "SGLang's CPU backend needs Intel AMX, which this CPU does not report"
    elif not sg_python.exists():
        sg.reason = f"SGLang is not installed (no {sg_python}); its CPU backend needs Intel AMX"
    else:
        sg.python = str(sg_python)
        sg.server = [
            sg.python,
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(hf),
            "--served-model-name",
            served_model,
            "--device",
            "cpu",
            "--host",
            "127.0.0.1",
        ]
    sg.no_server = sg.reason
    out["sglang"] = sg
    return out


def vllm_env(python: str, threads: int) -> dict:
    """What vLLM's CPU build needs to run well: a KV space it can allocate, its OpenMP
    threads bound to our cores, and Intel's OpenMP runtime preloaded."""
    venv = Path(python).parent.parent
    return {
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
        "LD_PRELOAD": str(venv / "lib" / "libiomp5.so"),
    }


def tokenworks_server(engine_argv: list[str], served_model: str) -> list[str]:
    """argv of our own server as a subprocess, like the peers'."""
    return [
        sys.executable,
        "-c",
        "import sys; from tokenworks.cli import main; sys.exit(main())",
        "serve",
        *engine_argv,
        "--served-model-name",
        served_model,
        "--host",
        "127.0.0.1",
        "--log-level",
        "warning",
    ]


@contextlib.contextmanager
def running_server(argv: list[str], env: dict, log_path: Path, timeout_s: float = 300.0):
    """Start a server (argv gets --port), wait until /v1/models answers, yield its base
    URL, and stop it on exit. A server that exits or stays silent raises PeerStartError
    with the tail of its log."""
    import httpx

    port = free_port()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "w")  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen(
        [*argv, "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **env},
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise PeerStartError(
                    f"{Path(argv[0]).name} exited with {proc.returncode}: {_tail(log_path)}"
                )
            if time.monotonic() > deadline:
                raise PeerStartError(f"no answer on {url} after {timeout_s:.0f} s")
            try:
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        yield url
    finally:
        if proc.poll() is None:  # the whole group: vLLM runs its engine in a child
            _signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
        log.close()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _tail(path: Path, n: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""
