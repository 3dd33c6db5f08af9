"""What model runs, and how its weights are held: the file, dtype, device, threads and
quantisation, and what the engine does around them (warm-up, detokenising, memory)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenworks.models.catalogue import DEFAULT_MODEL
from tokenworks.options import option

DTYPES = ("float32", "bfloat16", "float16")  # torch's names for them (torch_dtype)
DEFAULT_DTYPE = "bfloat16"  # the fast dtype on CPU and CUDA alike (float32 always runs)
QUANTIZATIONS = (None, "gguf", "none", "int8", "int4")  # None: gguf for a GGUF file on the CPU
MEMORY = "KV memory and scheduling"


@dataclass(frozen=True)
class ModelConfig:
    model: str = field(
        default=DEFAULT_MODEL,
        metadata=option("catalogue name, .gguf, dir or hub id", flag="--model", short="-m"),
    )
    dtype: str = field(
        default="auto",
        metadata=option("auto (fast for the device), float32, bfloat16 or float16"),
    )
    device: str = field(default="cpu", metadata=option("cpu or cuda[:N]"))
    threads: int | None = field(
        default=None, metadata=option("CPU threads for torch and the C kernels (default: torch's)")
    )
    max_model_len: int | None = field(
        default=None, metadata=option("context limit (default: the model's own)", group=MEMORY)
    )
    quantization: str | None = field(
        default=None,
        metadata=option(
            "how the weights are stored and multiplied: gguf (a GGUF file's own quantised "
            "blocks, executed as stored; the default for GGUF files on the CPU), none (every "
            "weight dequantised to --dtype), or weight-only int8 per row / int4 in groups of "
            "32 (CPU)",
            choices=["gguf", "none", "int8", "int4"],
        ),
    )
    dense_from_rows: int | None = field(
        default=None,
        metadata=option(
            "with --quantization: keep a dense copy of the dequantised weights for products "
            "of N or more rows (prefill, big batches), where it is faster (e.g. 8)",
            metavar="N",
        ),
    )
    keep_freed_memory: bool = field(
        default=True,
        metadata=option(
            "keep freed heap pages in the process, so each step's buffers reuse the last "
            "step's pages instead of faulting in new ones (engine/host_memory.py)"
        ),
    )
    keep_gguf_index: bool = field(
        default=True,
        metadata=option(
            "keep an index of a GGUF file's spec, tokenizer and tensor offsets under "
            "$TOKENWORKS_HOME/converted, so later loads skip reading its metadata "
            "(models/converted.py); --no-keep-gguf-index reads the file every time"
        ),
    )
    warmup: bool = field(
        default=True,
        metadata=option(
            "one forward pass at the token budget when the engine starts, so the first big "
            "step of the first requests does not pay for growing the heap and building "
            "torch's kernels (skipped where the C kernels run every batch as whole-step "
            "rows, which build nothing for it)",
            group=MEMORY,
        ),
    )
    detokenize: bool = field(
        default=True,
        metadata=option(
            "the engine turns tokens into text and applies stop strings; off, it sends token "
            "ids alone and its caller does both (the server's engine core process: "
            "engine/detokenizer.py in the API process)",
            group="output",
        ),
    )

    def __post_init__(self) -> None:
        self.check_model()

    def check_model(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of auto, {', '.join(DTYPES)}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device {self.device!r}: expected cpu or cuda[:N]")
        if self.device.startswith("cuda") and not cuda_available():
            raise ValueError(f"device {self.device!r} requested but torch sees no CUDA device")
        if self.dtype == "float16" and self.device == "cpu":
            raise ValueError("float16 runs on CUDA only; on CPU use bfloat16 or float32")
        if self.threads is not None and self.threads < 1:
            raise ValueError("threads must be >= 1")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization {self.quantization!r}: expected {', '.join(QUANTIZATIONS[1:])}"
            )
        if self.quantization in ("int8", "int4", "gguf") and self.device != "cpu":
            raise ValueError(
                f"{self.quantization} weight-only quantization uses torch's CPU kernels; "
                "on CUDA run without --quantization"
            )
        if self.dense_from_rows is not None and (
            self.quantization not in ("int8", "int4") or self.dense_from_rows < 1
        ):
            raise ValueError("dense_from_rows needs --quantization int8 or int4 and must be >= 1")

    def resolved_quantization(self, gguf_file: bool) -> str | None:
        """What the weights run as for a model read from a GGUF file (gguf_file) or not:
        None (dequantised to the dtype), "gguf" (the file's blocks), "int8" or "int4"."""
        if self.quantization is None:
            return "gguf" if gguf_file and self.device == "cpu" else None
        if self.quantization == "gguf" and not gguf_file:
            raise ValueError("quantization gguf runs a GGUF file's blocks; this model is no GGUF")
        return None if self.quantization == "none" else self.quantization

    @property
    def resolved_dtype(self) -> str:
        return DEFAULT_DTYPE if self.dtype == "auto" else self.dtype

    @property
    def torch_dtype(self):
        """The torch.dtype of resolved_dtype (torch is imported here, not with the config:
        the server's API process reads configs without it)."""
        import torch

        return getattr(torch, self.resolved_dtype)


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
