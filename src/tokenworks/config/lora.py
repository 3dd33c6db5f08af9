"""LoRA adapters' options: which adapters the engine serves over its base model, and how
many and how large it takes (engine/lora.py)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from tokenworks.options import option

LORA = "LoRA adapters"


def lora_modules_arg(text: str) -> tuple[str, ...]:
    """--lora-modules' parser: NAME=PATH[,NAME=PATH...]."""
    items = tuple(part.strip() for part in text.split(",") if part.strip())
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise argparse.ArgumentTypeError(f"{item!r}: expected NAME=PATH")
    return items


@dataclass(frozen=True)
class LoRAConfig:
    enable_lora: bool = field(
        default=False,
        metadata=option(
            "serve LoRA adapters over the base model, chosen per request by the model field "
            "(on with --lora-modules); adapters load and unload while serving",
            group=LORA,
        ),
    )
    lora_modules: tuple[str, ...] = field(
        default=(),
        metadata=option(
            "adapters loaded at start, NAME=PATH[,NAME=PATH...]: a PEFT directory "
            "(adapter_config.json, adapter_model.safetensors) or a GGUF LoRA file",
            group=LORA,
            type=lora_modules_arg,
            metavar="NAME=PATH",
        ),
    )
    max_loras: int = field(default=1, metadata=option("adapters loaded at once", group=LORA))
    max_lora_rank: int = field(
        default=16, metadata=option("the largest rank an adapter may have", group=LORA)
    )

    def __post_init__(self) -> None:
        self.check_lora()

    def check_lora(self) -> None:
        if self.lora_modules and not self.enable_lora:
            object.__setattr__(self, "enable_lora", True)
        if isinstance(self.lora_modules, list):
            object.__setattr__(self, "lora_modules", tuple(self.lora_modules))
        for item in self.lora_modules:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"lora_modules {item!r}: expected NAME=PATH")
        if self.max_loras < 1:
            raise ValueError("max_loras must be >= 1")
        if self.max_lora_rank < 1:
            raise ValueError("max_lora_rank must be >= 1")
        if len(self.lora_modules) > self.max_loras:
            raise ValueError(
                f"{len(self.lora_modules)} lora_modules but max_loras {self.max_loras}: "
                "raise --max-loras"
            )
