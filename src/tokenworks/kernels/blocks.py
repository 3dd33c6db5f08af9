"""A GGUF tensor as the file stores it, and the C products on its blocks.

`BlockTensor` is a matrix of a GGUF file kept as rows of quantised blocks (a view of the
memory-mapped file where no change was needed). The C kernels (csrc/block_products.h)
multiply by it without widening it: the activations are quantised 32 at a time to 8 bits
and each block pair multiplies in integers: AVX-512 VNNI where the CPU has it, else AVX2
(maddubs sums the products in pairs in int16, madd those in int32), else plain C. Types the
kernels do not execute are re-quantised to Q8_0 once, at load.

Where the kernels repack a type (csrc/repacked_products.h: eight rows' blocks together, so
one load of activations feeds eight rows), a product's weights are repacked once, when the
product is first viewed from C, into memory the process owns; the file's pages they came
from are then dropped from the resident set, so a model costs about its file's size once.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
from dataclasses import dataclass, field

import numpy as np
import torch

from tokenworks.kernels import abi as ck
from tokenworks.kernels.build import library

log = logging.getLogger("tokenworks.kernels")

# ggml type ids -> name: the formats the C kernels execute
EXECUTED = {
    2: "Q4_0",
    3: "Q4_1",
    6: "Q5_0",
    7: "Q5_1",
    8: "Q8_0",
    10: "Q2_K",
    11: "Q3_K",
    12: "Q4_K",
    13: "Q5_K",
    14: "Q6_K",
    16: "IQ2_XXS",
    17: "IQ2_XS",
    18: "IQ3_XXS",
    19: "IQ1_S",
    20: "IQ4_NL",
    21: "IQ3_S",
    22: "IQ2_S",
    23: "IQ4_XS",
    29: "IQ1_M",
    34: "TQ1_0",
    35: "TQ2_0",
    39: "MXFP4",
}
Q8_0 = 8
REPACK_STRETCH = 8 << 20  # bytes of the file repacked (then given back) at a time
DENSE = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}  # ggml types read as floats


def type_name(ggml_type: int) -> str:
    import gguf

    return gguf.GGMLQuantizationType(ggml_type).name


def block_shape(ggml_type: int) -> tuple[int, int]:
    """(elements, bytes) of one block of a ggml type."""
    import gguf

    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]


@dataclass
class BlockTensor:
    """A 2-D weight [rows, cols] (torch's order: out, in) as GGUF blocks of `ggml_type`;
    data is uint8 [rows, row_bytes]."""

    ggml_type: int
    shape: tuple[int, int]
    data: torch.Tensor
    mapped: bool = False  # data is a view of a memory-mapped file (its pages can be dropped)
    packed: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def rows(self, index) -> BlockTensor:
        """The rows `index` selects (a slice stays a view of the file; a list copies)."""
        data = self.data[index]
        view = self.mapped and isinstance(index, slice)
        return BlockTensor(self.ggml_type, (data.shape[0], self.shape[1]), data, view)

    def columns(self, index: slice) -> BlockTensor | None:
        """The columns `index` selects, copied out of every row: whole blocks only (None
        where a bound falls inside a block)."""
        per, nbytes = block_shape(self.ggml_type)
        start, stop, _ = index.indices(self.shape[1])
        if start % per or stop % per:
            return None
        data = self.data[:, start // per * nbytes : stop // per * nbytes].contiguous()
        return BlockTensor(self.ggml_type, (self.shape[0], stop - start), data)

    def padded(self, rows: int) -> BlockTensor:
        """This tensor with zero rows appended up to `rows` (a block of zero bytes holds a
        zero scale: its weights read as 0 in every executed format)."""
        pad = self.data.new_zeros(rows - self.shape[0], self.data.shape[1])
        return BlockTensor(self.ggml_type, (rows, self.shape[1]), torch.cat([self.data, pad]))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weights the blocks hold, [rows, cols] in dtype."""
        return dequantize(self, dtype)

    def repacked(self, lib) -> torch.Tensor | None:
        """The blocks repacked eight rows at a time (made once, then kept), or None for a
        type the kernels do not repack (or MXFP4 with a scale float16 cannot hold). A view
        of a mapped file gives its pages back as each stretch of rows is repacked, so the
        two copies never coexist whole."""
        if self.packed is None and lib.tw_r8_packs(self.ggml_type):
            rows, cols = self.shape
            data = self.data if self.data.is_contiguous() else self.data.contiguous()
            if not lib.tw_r8_exact(self.ggml_type, ck.ptr(data), rows, cols):
                if self.mapped and data is self.data:
                    release_pages(data)  # (the check read every page)
                return None
            out = torch.empty(lib.tw_r8_bytes(self.ggml_type, rows, cols), dtype=torch.uint8)
            release = self.mapped and data is self.data
            step = max(8, (REPACK_STRETCH // max(data.shape[1], 1)) // 8 * 8)
            for row in range(0, rows, step):
                part = data[row : row + step]
                at = lib.tw_r8_bytes(self.ggml_type, row, cols)
                lib.tw_r8_pack(
                    self.ggml_type, ck.ptr(part), part.shape[0], cols, ck.ptr(out) + at,
                    torch.get_num_threads(),
                )  # fmt: skip
                if release:
                    release_pages(part)
            if release:  # (the pages that straddled two stretches)
                release_pages(data)
            self.packed = out
        return self.packed


def from_array(ggml_type: int, shape: tuple[int, int], data: np.ndarray) -> BlockTensor:
    """A BlockTensor over raw bytes (a memory map's view is kept, not copied)."""
    rows = shape[0]
    raw = torch.from_numpy(np.asarray(data).view(np.uint8).reshape(rows, -1))
    return BlockTensor(ggml_type, shape, raw, isinstance(data, np.memmap))


def executable(ggml_type: int, shape: tuple[int, int], data: np.ndarray) -> BlockTensor:
    """A stored tensor in a format the kernels execute: as stored where it is one, else
    re-quantised once to Q8_0 (with a log line naming the type)."""
    if ggml_type in EXECUTED:
        return from_array(ggml_type, shape, data)
    import gguf

    _log_requantised(type_name(ggml_type))
    dense = gguf.quants.dequantize(np.asarray(data), ggml_type).reshape(shape)
    q = gguf.quants.quantize(dense.astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    return from_array(Q8_0, shape, q)


@functools.cache
def _log_requantised(name: str) -> None:
    log.info("%s blocks are not executed natively: re-quantised to Q8_0 at load", name)


def dequantize(t: BlockTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """t's weights in dtype: the C kernels where they run, else the gguf package's."""
    lib = library()
    rows, cols = t.shape
    if lib is not None and dtype in (torch.float32, torch.bfloat16):
        out = torch.empty(rows, cols, dtype=dtype)
        data = t.data.contiguous()
        lib.tw_block_dequantize(
            ck.ptr(data), t.ggml_type, rows, cols, ck.ptr(out), ck.DTYPE_CODES[dtype],
            torch.get_num_threads(),
        )  # fmt: skip
        return out
    import gguf

    arr = gguf.quants.dequantize(t.data.numpy(), t.ggml_type).reshape(rows, cols)
    return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).to(dtype)  # any dtype


def vector_isa(lib=None) -> str | None:
    """Which products on the blocks this build runs: "AVX-512 VNNI", "AVX2" or "plain C"
    (None without the C kernels); lib: another build than the default."""
    lib = lib or library()
    if lib is None:
        return None
    return {512: "AVX-512 VNNI", 256: "AVX2", 0: "plain C"}[lib.tw_blocks_isa()]


def use_portable(on: bool) -> bool:
    """Run the block products in plain C even where the vector path is built (for tests of
    the path CPUs without AVX-512 VNNI take). Returns whether the plain path is on."""
    lib = library()
    return lib is not None and bool(lib.tw_blocks_use_portable(int(on)))


def release_pages(data: torch.Tensor) -> None:
    """Drop the whole pages of a view of a memory-mapped file from this process's resident
    set (clean file pages, read again from the file should they be touched)."""
    page = mmap.PAGESIZE
    start = -(-data.data_ptr() // page) * page
    stop = (data.data_ptr() + data.numel() * data.element_size()) // page * page
    if stop > start:
        _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(stop - start), mmap.MADV_DONTNEED)


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def c_linear(
    parts: list[BlockTensor], bias: torch.Tensor | None, keep: list, repack: bool = True
) -> ck.Linear:
    """The C view of a product whose output rows are parts' rows in order (each part its
    own block type); bias (float32 [rows]) is split among them. keep holds what the view
    points at. repack: multiply the types the kernels repack on their repacked rows."""
    k = parts[0].shape[1]
    n = sum(p.shape[0] for p in parts)
    if bias is not None:
        bias = bias.detach().float().contiguous()
        keep.append(bias)
    views, row = [], 0
    lib = library()
    for p in parts:
        data, code = (p.repacked(lib) if repack and lib else None), ck.R8 + p.ggml_type
        if data is None:
            data = p.data if p.data.is_contiguous() else p.data.contiguous()
            code = ck.BLOCKS + p.ggml_type
        keep.append(data)
        b = None if bias is None else bias[row : row + p.shape[0]]
        views.append(ck.Linear(ck.ptr(data), None, ck.ptr(b), code, p.shape[0], k))
        row += p.shape[0]
    if len(views) == 1:
        return views[0]
    array = (ck.Linear * len(views))(*views)
    keep.append(array)
    return ck.Linear(
        None, None, None, ck.PARTS, n, k, ctypes.cast(array, ctypes.c_void_p), len(views)
    )


def block_linear(
    x: torch.Tensor, linear: ck.Linear, out_dtype: torch.dtype, lib=None
) -> torch.Tensor:
    """x [M, K] (float32 or bfloat16) @ W.T on the block weights `linear` -> [M, N]; lib:
    another build of the kernels (build.variant) than the default."""
    x = x if x.is_contiguous() else x.contiguous()
    y = torch.empty(x.shape[0], linear.n, dtype=out_dtype)
    (lib or library()).tw_block_linear(
        ck.ptr(x), ck.DTYPE_CODES[x.dtype], x.shape[0], ctypes.byref(linear), ck.ptr(y),
        ck.DTYPE_CODES[out_dtype], torch.get_num_threads(),
    )  # fmt: skip
    return y


def read_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float | None:
    """Bytes a second this machine's memory gives a streaming read with torch's thread
    count (csrc/stream_read.h, the best of `repeats` passes over nbytes), or None
    without the C kernels: the ceiling of a decode step that reads every weight once."""
    import time

    lib = library()
    if lib is None:
        return None
    buf = torch.ones(nbytes, dtype=torch.uint8)  # written once: every page resident
    best = float("inf")
    for _ in range(repeats + 1):
        t = time.perf_counter()
        lib.tw_stream_read(ck.ptr(buf), nbytes, torch.get_num_threads())
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def product_peaks(seconds: float = 0.2, repeats: int = 3) -> dict[str, float] | None:
    """Multiply-adds a second this CPU's vector units give with torch's thread count and no
    memory in the way (csrc/product_peak.h, the best of `repeats`): "int8" (bytes into int32,
    the block products' instruction) and "bfloat16" (bf16 pairs where the CPU has AVX-512
    BF16, else float32 multiply-adds). The ceilings a prompt's products are measured
    against; None without the C kernels."""
    import time

    lib = library()
    if lib is None:
        return None
    threads, out = torch.get_num_threads(), {}
    for kind, name in enumerate(("int8", "bfloat16")):
        rounds = 1 << 16
        while True:  # rounds enough for `seconds`
            t = time.perf_counter()
            lib.tw_product_peak(kind, rounds, threads)
            took = time.perf_counter() - t
            if took >= seconds / 4:
                break
            rounds *= 4
        rounds = int(rounds * seconds / took) + 1
        best = 0.0
        for _ in range(repeats):
            t = time.perf_counter()
            macs = lib.tw_product_peak(kind, rounds, threads)
            best = max(best, macs / (time.perf_counter() - t))
        out[name] = best
    return out
