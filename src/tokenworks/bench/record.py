"""Evidence records: every measured figure, with what is needed to trust and repeat it.

A record holds the command, the git commit and dirty flag, the hardware, the software
versions, the model (id, file sha256, dtype and every numerics option of the engine
config), the workload manifest and its sha256, the seeds, and the raw per-request results.
A figure with no record is NOT_RUN.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

from tokenworks import environment

SCHEMA = "tokenworks.evidence/1"


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_state() -> dict:
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def hardware() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = None
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "memory_bytes": mem, "gpu": None}
    try:
        import torch

        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def software() -> dict:
    versions = {"python": platform.python_version()}
    for pkg in ("torch", "numpy", "tokenizers", "gguf", "transformers", "tokenworks"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    return versions


def manifest_sha256(manifest: dict) -> str:
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()


def make_record(
    *,
    kind: str,
    engine: dict,
    model: dict,
    workload: dict,
    results: dict,
    seeds: list[int] | None = None,
    peers: dict | None = None,
) -> dict:
    return {
        "schema": SCHEMA,
        "kind": kind,
        "created_unix": time.time(),
        "command": " ".join(sys.argv),
        "git": git_state(),
        "hardware": hardware(),
        "software": software(),
        "environment": environment.snapshot(),
        "engine": engine,
        "model": model,
        "workload": {"manifest": workload, "sha256": manifest_sha256(workload)},
        "seeds": seeds or [],
        "results": results,
        "peers": peers or {},
    }


def make_not_run(*, kind: str, engine: dict, workload: dict, reason: str) -> dict:
    """A record for an engine or machine that is not there: it says why, and holds no
    figure (reports print NOT_RUN for it)."""
    record = make_record(kind=kind, engine=engine, model={}, workload=workload, results={})
    record["status"] = "NOT_RUN"
    record["reason"] = reason
    return record


def write_record(record: dict, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(record["created_unix"]))
    path = out / f"{record['kind']}-{stamp}.json"
    n = 1
    while path.exists():  # two records in one second: never overwrite evidence
        n += 1
        path = out / f"{record['kind']}-{stamp}-{n}.json"
    path.write_text(json.dumps(record, indent=2, sort_keys=False) + "\n")
    return path


def model_record(llm) -> dict:
    """What a record says of the model an LLM runs: identity, file checksum, numerics."""
    loaded = llm.engine.loaded
    return {
        "id": loaded.model_id,
        "file": loaded.file_path,
        "sha256": loaded.file_sha256,
        "dtype": llm.config.resolved_dtype,
        "quantization": llm.engine.quantization or "none",  # as resolved for this file
        "spec": loaded.spec.name,
    }
