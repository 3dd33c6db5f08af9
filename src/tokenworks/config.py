"""Engine configuration: every option that changes numerics or capacity, named once.

Each field here is written into every evidence record, so two measurements can be
compared knowing exactly what differed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

QUANTIZATIONS = (None, "int8", "int4")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_dtype(device: str) -> str:
    """The fast dtype for the device: bfloat16 on CPU and CUDA (float32 is always available)."""
    return "bfloat16"


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2-135m"
    dtype: str = "auto"
    device: str = "cpu"
    threads: int | None = None  # torch intra-op threads on CPU; None leaves torch's default
    max_num_seqs: int = 8  # sequences decoded together
    max_model_len: int | None = None  # context limit; None: the model's own
    attention: str = "sdpa"  # the attention kernel (recorded; more backends come later)
    quantization: str | None = None  # None (the file's weights, dequantised), "int8", "int4"

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of auto, {', '.join(DTYPES)}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device {self.device!r}: expected cpu or cuda[:N]")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} requested but torch sees no CUDA device")
        if self.dtype == "float16" and self.device == "cpu":
            raise ValueError("float16 runs on CUDA only; on CPU use bfloat16 or float32")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization {self.quantization!r}: expected none, {', '.join(QUANTIZATIONS[1:])}"
            )
        if self.quantization is not None and self.device != "cpu":
            raise ValueError(
                f"{self.quantization} weight-only quantization uses torch's CPU kernels; "
                "on CUDA run without --quantization"
            )
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.threads is not None and self.threads < 1:
            raise ValueError("threads must be >= 1")

    @property
    def resolved_dtype(self) -> str:
        return default_dtype(self.device) if self.dtype == "auto" else self.dtype

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.resolved_dtype]

    def to_dict(self) -> dict:
        return {**asdict(self), "dtype": self.resolved_dtype}
