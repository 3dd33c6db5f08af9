"""`tokenworks env`: what this machine runs, for bug reports and for reading a record.

Like `vllm collect-env`: versions, the CPU and its features, and which kernel paths run
here, with the reason for each that does not.
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
import sys

from tokenworks.bench.peer_engines import cpu_flags
from tokenworks.bench.record import hardware

PACKAGES = (
    "tokenworks", "torch", "numpy", "tokenizers", "gguf", "safetensors", "llguidance",
    "transformers", "fastapi", "uvicorn", "pydantic",
)  # fmt: skip
FEATURES = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")


def cpu() -> dict:
    """The CPU's model name, core count and the instruction sets the kernels care about."""
    hw, flags = hardware(), cpu_flags()
    return {"model": hw["cpu"], "cores": hw["cores"], "features": {f: f in flags for f in FEATURES}}


def versions() -> dict:
    out = {"python": sys.version.split()[0], "platform": platform.platform()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def kernel_paths() -> list[dict]:
    """Each kernel path: whether it runs here, and why not where it does not."""
    import torch

    from tokenworks.kernels import attention, blocks, build, products

    flags = cpu()["features"]
    lib = build.library()
    paths = [
        {
            "path": "C kernels (kernels/csrc, built with the system compiler)",
            "active": lib is not None,
            "why_not": build.unavailable(),
            "detail": f"compiler {build.compiler()}, source {build.SOURCE}",
        }
    ]
    need_c = "the C kernels are not built" if lib is None else ""
    isa = blocks.vector_isa()
    paths.append(
        {
            "path": f"GGUF block products in integers ({isa or 'AVX-512 VNNI, AVX2 or plain C'})",
            "active": isa not in (None, "plain C"),
            "why_not": need_c or "the CPU has neither AVX-512 VNNI nor AVX2: plain C",
        }
    )
    packed_why = need_c or ("" if products.packed_built() else "the CPU has no AVX-512 BF16")
    paths.append(
        {
            "path": "packed bfloat16 products (AVX-512 BF16 dot products or AMX tiles)",
            "active": products.packed_built(),
            "why_not": packed_why,
        }
    )
    if products.tiles_granted():
        tiles_why = ""
    elif need_c:
        tiles_why = need_c
    elif not (flags["amx_tile"] and flags["amx_bf16"]):
        tiles_why = "the CPU has no AMX (amx_tile, amx_bf16)"
    else:
        tiles_why = "Linux did not grant this process the AMX tile state"
    paths.append({"path": "AMX tiles", "active": products.tiles_granted(), "why_not": tiles_why})
    paths.append(
        {
            "path": "prompt attention in C (head_dim 64, bfloat16)",
            "active": attention.prefill_available(),
            "why_not": need_c
            or ("" if attention.prefill_available() else "needs AMX or AVX-512 BF16"),
        }
    )
    onednn = torch.backends.mkldnn.is_available()
    paths.append(
        {
            "path": "oneDNN prepacked bfloat16 products (torch)",
            "active": onednn,
            "why_not": "" if onednn else "this torch build has no oneDNN",
        }
    )
    paths.append(
        {
            "path": "CUDA",
            "active": torch.cuda.is_available(),
            "why_not": "" if torch.cuda.is_available() else "torch sees no CUDA device",
        }
    )
    return paths


def collect() -> dict:
    import torch

    from tokenworks.paths import home

    return {
        "versions": versions(),
        "cpu": cpu(),
        "torch_threads": torch.get_num_threads(),
        "cache": str(home()),
        "kernels": kernel_paths(),
        "default_kernels": "kernels=auto: the C kernels for bfloat16 and quantised weights on "
        "the CPU where they build; torch's modules for float32 and on CUDA",
    }


def render(info: dict) -> str:
    lines = ["versions:"]
    lines += [
        f"  {k}: {v if v is not None else 'not installed'}" for k, v in info["versions"].items()
    ]
    c = info["cpu"]
    have = [f for f, on in c["features"].items() if on]
    lacks = [f for f, on in c["features"].items() if not on]
    lines += [
        f"cpu: {c['model']} ({c['cores']} cores)",
        f"  has: {', '.join(have) or 'none of ' + ', '.join(FEATURES)}",
        f"  lacks: {', '.join(lacks) or 'nothing listed'}",
        f"torch threads: {info['torch_threads']}",
        f"cache: {info['cache']}",
        "kernel paths:",
    ]
    for p in info["kernels"]:
        state = "on " if p["active"] else "off"
        why = f" ({p['why_not']})" if not p["active"] and p["why_not"] else ""
        lines.append(f"  [{state}] {p['path']}{why}")
    lines.append(info["default_kernels"])
    return "\n".join(lines)


def main(as_json: bool = False) -> int:
    info = collect()
    print(json.dumps(info, indent=1) if as_json else render(info))
    return 0
