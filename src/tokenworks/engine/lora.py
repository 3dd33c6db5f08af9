"""LoRA adapters: read from PEFT's directories (adapter_config.json and
adapter_model.safetensors) or llama.cpp's GGUF LoRA files, and served by name over one
base model, each in a slot of its own (engine/lora_layers.py applies them).

An adapter's weights stay apart from the base's, in the engine's dtype: merging them into
W would give one adapter the whole model. Adapters load and unload while the engine runs;
one still used by requests in flight keeps its slot until they end.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tokenworks.engine.lora_layers import TARGETS, BatchRows, wrap_layers
from tokenworks.engine.messages import LoRANotFoundError
from tokenworks.engine.prefix_cache import adapter_salt
from tokenworks.plan.memory import lora_bytes

log = logging.getLogger("tokenworks.engine")

# llama.cpp's tensor names -> PEFT's module names
GGUF_TARGETS = {
    "attn_q": "q_proj",
    "attn_k": "k_proj",
    "attn_v": "v_proj",
    "attn_output": "o_proj",
    "ffn_gate": "gate_proj",
    "ffn_up": "up_proj",
    "ffn_down": "down_proj",
}


@dataclass
class Adapter:
    name: str
    path: str
    rank: int
    scale: float  # alpha / rank (alpha / sqrt(rank) with rsLoRA)
    # (layer, PEFT module name) -> (A [r, in], B [out, r]), float32
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def read_adapter(name: str, path: str) -> Adapter:
    """A PEFT directory or a GGUF LoRA file."""
    p = Path(path).expanduser()
    if p.is_dir():
        return read_peft(name, p)
    if p.suffix == ".gguf" and p.is_file():
        return read_gguf_lora(name, p)
    raise ValueError(
        f"LoRA adapter {name!r}: {path} is neither a PEFT directory (adapter_config.json and "
        "adapter_model.safetensors) nor a .gguf LoRA file"
    )


def read_peft(name: str, path: Path) -> Adapter:
    from safetensors.torch import load_file

    config_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not config_file.is_file() or not weights_file.is_file():
        raise ValueError(f"LoRA adapter {name!r}: {path} needs adapter_config.json and "
                         "adapter_model.safetensors")  # fmt: skip
    config = json.loads(config_file.read_text())
    refused = {
        "use_dora": "DoRA adapters",
        "modules_to_save": "adapters that replace whole modules (modules_to_save)",
        "rank_pattern": "a rank per module (rank_pattern)",
        "alpha_pattern": "an alpha per module (alpha_pattern)",
    }
    for key, what in refused.items():
        if config.get(key):
            raise ValueError(f"LoRA adapter {name!r}: {what} are not served")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {name!r}: adapters that train biases are not served")
    rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    tensors = load_file(str(weights_file))
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        parts = key.split(".")
        if "lora_A" not in parts and "lora_B" not in parts:
            raise ValueError(f"LoRA adapter {name!r}: tensor {key} is not a LoRA A or B")
        at = parts.index("lora_A") if "lora_A" in parts else parts.index("lora_B")
        module = parts[at - 1]
        if module not in TARGETS or "layers" not in parts:
            raise ValueError(
                f"LoRA adapter {name!r}: {key} targets {module}; served are the attention "
                f"and MLP products ({', '.join(TARGETS)})"
            )
        layer = int(parts[parts.index("layers") + 1])
        pairs.setdefault((layer, module), {})[parts[at][-1]] = t.float()
    return Adapter(name, str(path), rank, scale, _paired(name, pairs))


def read_gguf_lora(name: str, path: Path) -> Adapter:
    import gguf

    reader = gguf.GGUFReader(str(path))
    fields = {f.name: f for f in reader.fields.values()}

    def value(key):
        f = fields.get(key)
        return None if f is None else f.contents()

    if value("general.type") != "adapter" or value("adapter.type") != "lora":
        raise ValueError(f"LoRA adapter {name!r}: {path} is a GGUF file but not a LoRA adapter")
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for t in reader.tensors:
        base, _, which = t.name.rpartition(".lora_")
        parts = base.split(".")  # blk.N.attn_q.weight
        if which not in ("a", "b") or parts[0] != "blk" or parts[2] not in GGUF_TARGETS:
            raise ValueError(f"LoRA adapter {name!r}: tensor {t.name} is not served")
        if t.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            raise ValueError(f"LoRA adapter {name!r}: {t.name} is {t.tensor_type.name}; "
                             "LoRA tensors are read in F32 or F16")  # fmt: skip
        shape = [int(d) for d in reversed(t.shape)]  # GGUF lists dimensions innermost first
        data = torch.from_numpy(t.data.reshape(shape).copy()).float()
        pairs.setdefault((int(parts[1]), GGUF_TARGETS[parts[2]]), {})[which.upper()] = data
    a_any = next(iter(pairs.values()), {}).get("A")
    rank = int(a_any.shape[0]) if a_any is not None else 0
    alpha = value("adapter.lora.alpha")
    scale = float(alpha) / rank if alpha and rank else 1.0
    return Adapter(name, str(path), rank, scale, _paired(name, pairs))


def _paired(name: str, pairs: dict) -> dict:
    out = {}
    for (layer, module), ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: layer {layer} {module} lacks lora_A or "
                             "lora_B")  # fmt: skip
        out[(layer, module)] = (ab["A"], ab["B"])
    if not out:
        raise ValueError(f"LoRA adapter {name!r} holds no LoRA weights")
    return out


class LoRAAdapters:
    """The adapters an engine serves, by name, in at most max_loras slots."""

    def __init__(self, model, max_loras: int, max_rank: int, dtype: torch.dtype, device,
                 in_use=frozenset):  # fmt: skip
        """in_use(): the adapters requests in flight hold (an unloaded one's slot is
        reused once none does)."""
        self.model, self.max_loras, self.max_rank = model, max_loras, max_rank
        self.in_use = in_use
        self.dtype, self.device = dtype, device
        self.rows = BatchRows()
        self.products = wrap_layers(model, self.rows)
        self.adapters: dict[str, Adapter] = {}
        self.slots: dict[str, int] = {}
        self.retired: dict[str, int] = {}  # unloaded, their slot kept for requests in flight

    def load(self, name: str, path: str) -> Adapter:
        """Read an adapter and give it a slot."""
        if name in self.adapters:
            raise ValueError(f"LoRA adapter {name!r} is loaded already; unload it first")
        self.free_retired()
        adapter = read_adapter(name, path)
        if adapter.rank > self.max_rank:
            raise ValueError(f"LoRA adapter {name!r} has rank {adapter.rank}, above "
                             f"--max-lora-rank {self.max_rank}")  # fmt: skip
        taken = set(self.slots.values()) | set(self.retired.values())
        free = [s for s in range(self.max_loras) if s not in taken]
        if not free:
            raise ValueError(f"{self.max_loras} LoRA adapters are loaded (--max-loras): "
                             "unload one first")  # fmt: skip
        self._place(adapter, free[0])
        self.adapters[name], self.slots[name] = adapter, free[0]
        log.info("LoRA adapter %s loaded from %s: rank %d, %.1f MB", name, path, adapter.rank,
                 adapter.nbytes / 1e6)  # fmt: skip
        return adapter

    def _place(self, adapter: Adapter, slot: int) -> None:
        spec = self.model.spec
        per_product: dict[tuple[int, str], list] = {}
        for (layer, module), (a, b) in adapter.weights.items():
            product, part = TARGETS[module]
            lora = self.products.get((layer, product))
            if lora is None:
                raise ValueError(f"LoRA adapter {adapter.name!r}: the model has no layer {layer}")
            lo, hi = lora.bounds[part]
            base_in = a.shape[1]
            want_in = spec.q_size if product == "o_proj" else (
                spec.intermediate_size if product == "down" else spec.hidden_size)  # fmt: skip
            if base_in != want_in or b.shape[0] != hi - lo or a.shape[0] != b.shape[1]:
                raise ValueError(
                    f"LoRA adapter {adapter.name!r}: layer {layer} {module} has shapes "
                    f"{tuple(a.shape)} and {tuple(b.shape)}; this model needs [r, {want_in}] "
                    f"and [{hi - lo}, r]: it was trained on another base model"
                )
            parts = per_product.setdefault((layer, product), [None] * len(lora.bounds))
            on = dict(dtype=self.dtype, device=self.device)
            parts[part] = (a.to(**on), b.to(**on), adapter.scale)
        for key, parts in per_product.items():
            self.products[key].weights[slot] = parts
            self.products[key].pack()

    def unload(self, name: str) -> None:
        """Stop serving an adapter; requests in flight with it finish with it."""
        if name not in self.adapters:
            raise LoRANotFoundError(f"LoRA adapter {name!r} is not loaded")
        del self.adapters[name]
        self.retired[name] = self.slots.pop(name)
        self.free_retired()

    def free_retired(self) -> None:
        if not self.retired:
            return
        in_use = self.in_use()
        for name in [n for n in self.retired if n not in in_use]:
            slot = self.retired.pop(name)
            for lora in self.products.values():
                if lora.weights.pop(slot, None) is not None:
                    lora.pack()

    def slot_of(self, name: str | None) -> int:
        """A request's adapter slot (-1: the base model)."""
        if name is None:
            return -1
        slot = self.slots.get(name, self.retired.get(name))
        if slot is None:
            raise LoRANotFoundError(f"LoRA adapter {name!r} is not loaded")
        return slot


def open_loras(config, model, kernels, in_use) -> LoRAAdapters | None:
    """The engine's adapters where its config enables them, --lora-modules loaded; where
    the engine runs the C kernels (kernels/backend.py's, or None), their deltas are added
    in C and the C pass runs the batches with adapter rows between its calls."""
    if not config.enable_lora:
        return None
    loras = LoRAAdapters(model, config.max_loras, config.max_lora_rank, config.torch_dtype,
                         config.device, in_use)  # fmt: skip
    if kernels is not None:
        loras.rows.c_deltas = True
        kernels.forward_pass.adapters = loras.rows
    for item in config.lora_modules:
        name, _, path = item.partition("=")
        loras.load(name, path)
    return loras


def request_salt(loras: LoRAAdapters | None, lora: str | None, cache_salt: str | None):
    """The prefix cache's salt for a request of adapter `lora` (prefix_cache.adapter_salt);
    one not loaded is refused."""
    if lora is not None and (loras is None or lora not in loras.adapters):
        served = "" if loras is not None else ": this engine serves none (--enable-lora)"
        raise LoRANotFoundError(f"LoRA adapter {lora!r} is not loaded{served}")
    return adapter_salt(cache_salt, lora)


def lora_reserve(config, shape) -> int:
    """Bytes the adapters an engine may load take at most (--max-loras of --max-lora-rank
    on every product, in its dtype; 0 without LoRA): kept out of the KV pool's budget."""
    if not config.enable_lora:
        return 0
    size = torch.tensor([], dtype=config.torch_dtype).element_size()
    return config.max_loras * lora_bytes(shape, config.max_lora_rank, size)
