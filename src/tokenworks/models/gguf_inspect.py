"""`tokenworks inspect FILE`: what a GGUF file asks for and what tokenworks will do with it,
key by key (read, informational or refused, and why: models/gguf_keys.py), its tensors by
block type (executed as stored, read as floats, or re-quantised to Q8_0 at load), and the
model it loads as, or the one line that refuses it."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from tokenworks.models import gguf_keys
from tokenworks.models.loaded import ModelLoadError


def _shown(value) -> object:
    if isinstance(value, list) and len(value) > 8:
        return f"[{len(value)} items]"
    if isinstance(value, str) and len(value) > 60:
        return value[:57].replace("\n", " ") + "..."
    return value


def inspect(path: str | Path) -> dict:
    """The file's verdicts, tensor types and loaded spec (or refusal) as one dict; raises
    ModelLoadError where the file cannot be read at all."""
    from tokenworks.kernels import blocks
    from tokenworks.models import arch as arch_registry
    from tokenworks.models.gguf_file import _field, load_gguf, open_reader

    path = Path(path)
    reader = open_reader(path)
    arch = str(_field(reader, "general.architecture", ""))
    try:
        family = arch_registry.for_gguf_arch(arch)
    except arch_registry.UnknownArchitectureError:
        family = None
    keys = []
    for key in reader.fields:
        try:
            value = _field(reader, key)
        except Exception as e:  # a field the gguf package cannot decode
            value = f"<unreadable: {type(e).__name__}>"
        v = gguf_keys.judge(key, value, arch, family)
        keys.append({"key": key, "value": _shown(value), "action": v.action, "why": v.why})
    types = Counter(int(t.tensor_type) for t in reader.tensors)
    tensors = []
    for ggml_type, count in sorted(types.items()):
        if ggml_type in blocks.EXECUTED:
            how = "executed as stored by the C kernels"
        elif ggml_type in blocks.DENSE:
            how = "read as floats"
        else:
            how = "re-quantised to Q8_0 at load (no kernel for this type)"
        tensors.append({"type": blocks.type_name(ggml_type), "tensors": count, "runs": how})
    out = {"file": str(path), "architecture": arch, "family": family and family.name, "keys": keys,
           "tensor_types": tensors}  # fmt: skip
    try:
        spec = load_gguf(path, weights=False, reader=reader).spec
    except ModelLoadError as e:
        return out | {"loads": False, "refused": str(e)}
    shown = ("n_layers", "hidden_size", "n_heads", "n_kv_heads", "head_dim",
             "intermediate_size", "vocab_size", "max_position", "sliding_window")  # fmt: skip
    summary = {k: getattr(spec, k) for k in shown}
    summary["rope_scaling"] = spec.rope_scaling and spec.rope_scaling.kind
    return out | {"loads": True, "spec": summary}


def render(report: dict) -> str:
    family = f"family {report['family']}" if report["family"] else "not built"
    lines = [f"{report['file']}: architecture {report['architecture']!r} ({family})"]
    width = max((len(k["key"]) for k in report["keys"]), default=0)
    lines.append("")
    for k in report["keys"]:
        lines.append(f"  {k['key']:<{width}}  {k['action']:<13}  {k['why']}: {k['value']!r}")
    lines += ["", "tensors:"]
    for t in report["tensor_types"]:
        lines.append(f"  {t['type']:<8} {t['tensors']:>5}  {t['runs']}")
    lines.append("")
    if report["loads"]:
        spec = ", ".join(f"{k} {v}" for k, v in report["spec"].items())
        lines.append(f"loads: {spec}")
    else:
        lines.append(f"refused: {report['refused']}")
    return "\n".join(lines)


def run(args) -> int:
    report = inspect(args.file)
    print(json.dumps(report, default=str) if args.json else render(report))
    return 0 if report["loads"] else 2
