"""The C decode kernels (csrc/decode.c): built with the system C compiler, loaded with ctypes.

The first use compiles the file for this machine (`cc -O3 -march=native -fopenmp`, about a
second) into `$TOKENWORKS_HOME/kernels/`, named by a hash of the source, the flags and the
CPU, so an edit, a new compiler flag or another CPU builds afresh and a cached build is
never used where it was not made. No torch headers are involved: tensors are passed as raw
pointers. OpenMP comes from the libgomp torch has already loaded, so the kernels and torch
share one thread pool.

Where the library cannot be built (no compiler, TOKENWORKS_NO_C_KERNELS set), `library()`
returns None and callers keep the pure-torch path.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from tokenworks.models.catalogue import home

log = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "csrc" / "decode.c"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]

F32, BF16, I8, Q4, AMX = 0, 1, 2, 3, 4  # Q4: ops/linear.q4_blocks; AMX: amx_pack's layout
AMX_GLU = 5  # a gate_up weight in amx_pack(glu=True)'s layout: its product ends in SwiGLU
GLU = 101  # tw_amx_linear's y_dtype for those: y is silu(gate) * up (decode.c's TW_GLU)
DTYPE_CODES = {torch.float32: F32, torch.bfloat16: BF16, torch.int8: I8}

c_ptr = ctypes.c_void_p


class Linear(ctypes.Structure):
    _fields_ = [
        ("w", c_ptr),
        ("scale", c_ptr),
        ("bias", c_ptr),
        ("dtype", ctypes.c_int),
        ("n", ctypes.c_int),
        ("k", ctypes.c_int),
    ]


class KV(ctypes.Structure):
    _fields_ = [
        ("k_pool", c_ptr),
        ("v_pool", c_ptr),
        ("kv_dtype", ctypes.c_int),
        ("block_tables", c_ptr),
        ("max_blocks", ctypes.c_int),
        ("context_lens", c_ptr),
        ("block_size", ctypes.c_int),
        ("window", ctypes.c_int),
    ]


class Dims(ctypes.Structure):
    _fields_ = [
        ("hidden", ctypes.c_int),
        ("n_heads", ctypes.c_int),
        ("n_kv_heads", ctypes.c_int),
        ("head_dim", ctypes.c_int),
        ("intermediate", ctypes.c_int),
        ("vocab", ctypes.c_int),
        ("eps", ctypes.c_float),
        ("attn_scale", ctypes.c_float),
    ]


class Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", c_ptr),
        ("post_norm", c_ptr),
        ("qkv", Linear),
        ("o", Linear),
        ("gate_up", Linear),
        ("down", Linear),
        ("k_pool", c_ptr),
        ("v_pool", c_ptr),
    ]


class Model(ctypes.Structure):
    _fields_ = [
        ("embed", c_ptr),
        ("embed_dtype", ctypes.c_int),
        ("final_norm", c_ptr),
        ("head", Linear),
        ("cos", c_ptr),
        ("sin", c_ptr),
    ]


class Scratch(ctypes.Structure):
    _fields_ = [(name, c_ptr) for name in ("h", "hb", "qkv", "attn", "gu", "act")]


def kv_view(tables, lens, block_size, window, kv_dtype, k_pool=None, v_pool=None):
    """A KV struct over block tables [B, max_blocks] and context lengths [B] (int64,
    contiguous: the caller keeps them alive during the call); pools may be set later."""
    return KV(
        ptr(k_pool), ptr(v_pool), kv_dtype, ptr(tables), tables.shape[1], ptr(lens),
        block_size, window or 0,
    )  # fmt: skip


def ptr(t: torch.Tensor | None) -> int | None:
    """A contiguous CPU tensor's data address (None passes NULL)."""
    if t is None:
        return None
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("the C kernels take contiguous CPU tensors")
    return t.data_ptr()


def _cpu_tag() -> str:
    """What -march=native depends on: the CPU model and its feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        keep = [x for x in lines if x.startswith(("model name", "flags"))][:2]
        return "\n".join(keep)
    except OSError:
        return platform.processor() or platform.machine()


def _build(cc: str) -> Path:
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + "\0".join([cc, *FLAGS, _cpu_tag()]).encode()).hexdigest()[:16]
    target = home() / "kernels" / f"decode-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        run = subprocess.run(
            [cc, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True
        )
        if run.returncode != 0:
            raise RuntimeError(f"{cc} failed:\n{run.stderr.strip()}")
        os.replace(tmp, target)  # atomic: concurrent builders never see half a file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def compiler() -> str | None:
    """The C compiler the kernels are built with: $CC, else cc, else gcc (None: none)."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None where they cannot be built here (the reason is logged)."""
    if os.environ.get("TOKENWORKS_NO_C_KERNELS"):
        return None
    cc = compiler()
    if cc is None:
        log.warning("no C compiler (cc, gcc or $CC): the C decode kernels are off")
        return None
    try:
        lib = ctypes.CDLL(str(_build(cc)))
    except (OSError, RuntimeError) as e:
        log.warning("the C decode kernels could not be built (%s); using torch", e)
        return None
    lib.tw_paged_attention.restype = None
    lib.tw_paged_attention.argtypes = [
        ctypes.POINTER(KV),
        c_ptr,
        c_ptr,
        *[ctypes.c_int] * 4,
        ctypes.c_float,
        ctypes.c_int,
    ]
    lib.tw_llama_decode.restype = None
    lib.tw_llama_decode.argtypes = [
        ctypes.POINTER(Dims),
        ctypes.POINTER(Model),
        ctypes.POINTER(Layer),
        ctypes.c_int,
        ctypes.POINTER(KV),
        c_ptr,
        c_ptr,
        c_ptr,
        ctypes.c_int,
        c_ptr,
        ctypes.POINTER(Scratch),
        c_ptr,
        c_ptr,
        ctypes.c_int,
    ]
    lib.tw_residual_norm.restype = None
    lib.tw_residual_norm.argtypes = [
        c_ptr,
        c_ptr,
        ctypes.c_int,
        c_ptr,
        ctypes.c_float,
        c_ptr,
        *[ctypes.c_int] * 4,
    ]
    lib.tw_swiglu.restype = None
    lib.tw_swiglu.argtypes = [c_ptr, c_ptr, *[ctypes.c_int] * 4]
    lib.tw_rope_attend.restype = None
    lib.tw_rope_attend.argtypes = [
        ctypes.POINTER(Dims),
        ctypes.POINTER(KV),
        c_ptr,
        c_ptr,
        ctypes.c_int,
        *[c_ptr] * 4,
        ctypes.c_int,
        ctypes.c_int,
    ]
    lib.tw_rope_store.restype = None
    lib.tw_rope_store.argtypes = [
        ctypes.POINTER(Dims),
        c_ptr,
        c_ptr,
        ctypes.c_int,
        c_ptr,
        ctypes.c_int,
        *[c_ptr] * 4,
        ctypes.c_int,
        ctypes.c_int,
    ]
    lib.tw_argmax_rows.restype = None
    lib.tw_argmax_rows.argtypes = [c_ptr, *[ctypes.c_int] * 3, c_ptr, ctypes.c_int]
    lib.tw_amx_init.restype = ctypes.c_int
    lib.tw_amx_init.argtypes = []
    lib.tw_use_tiles.restype = ctypes.c_int
    lib.tw_use_tiles.argtypes = [ctypes.c_int]
    lib.tw_packed_kind.restype = ctypes.c_int
    lib.tw_packed_kind.argtypes = []
    lib.tw_amx_pack.restype = None
    lib.tw_amx_pack.argtypes = [c_ptr, ctypes.c_int, ctypes.c_int, c_ptr, ctypes.c_int]
    lib.tw_amx_linear.restype = ctypes.c_int
    lib.tw_amx_linear.argtypes = [
        c_ptr, ctypes.c_int, ctypes.c_int, c_ptr, ctypes.c_int, c_ptr, c_ptr, ctypes.c_int,
        ctypes.c_int,
    ]  # fmt: skip
    lib.tw_prefill_attention.restype = ctypes.c_int
    lib.tw_prefill_attention.argtypes = [
        c_ptr, c_ptr, ctypes.c_int, ctypes.c_int, c_ptr, ctypes.c_int64, *[c_ptr] * 5,
        ctypes.c_int, ctypes.c_float, c_ptr, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
    ]  # fmt: skip
    return lib


@functools.cache
def amx_available() -> bool:
    """Whether AMX tiles run here: the kernels built with AMX (the CPU has it) and the OS
    granted the tile state. TOKENWORKS_NO_AMX turns them off (the packed products then run
    as AVX-512 BF16 dot products)."""
    lib = library()
    if lib is None or os.environ.get("TOKENWORKS_NO_AMX"):
        return False
    return bool(lib.tw_amx_init())


@functools.cache
def packed_available() -> bool:
    """Whether the packed products run here (amx_pack, amx_product, and the whole decode
    step of bigger batches on packed weights): on AMX tiles where amx_available(), else as
    AVX-512 BF16 dot products on the same layout. TOKENWORKS_NO_PACKED turns them off
    (oneDNN's products then)."""
    lib = library()
    if lib is None or os.environ.get("TOKENWORKS_NO_PACKED"):
        return False
    amx_available()  # the tiles first, where they run
    return lib.tw_packed_kind() > 0


def tiles_on() -> bool:
    """Whether the packed products run on AMX tiles now (not within vector_products)."""
    lib = library()
    return lib is not None and lib.tw_packed_kind() == 2


@contextlib.contextmanager
def vector_products():
    """Within it, the packed products run as AVX-512 BF16 dot products even where AMX
    tiles run: that path, tested and measured on CPUs with both."""
    lib = library()
    lib.tw_use_tiles(0)
    try:
        yield
    finally:
        lib.tw_use_tiles(int(amx_available()))


def glu_order(t: torch.Tensor) -> torch.Tensor:
    """The rows (or entries) of a gate_up weight (or bias), gate rows then up rows, in the
    order amx_pack(glu=True) packs them: gate 0-15, up 0-15, gate 16-31, up 16-31, ..."""
    n = t.shape[0]
    return t.reshape(2, n // 32, 16, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def packed_bias(bias: torch.Tensor | None, glu: bool = False) -> torch.Tensor | None:
    """A packed product's bias: float32, contiguous, in glu_order for glu products."""
    if bias is None:
        return None
    b = bias.detach().float()
    return (glu_order(b) if glu else b).contiguous()


def amx_pack(w: torch.Tensor, glu: bool = False) -> torch.Tensor | None:
    """A copy of bfloat16 w [N, K] in the packed layout of tw_amx_pack (N and K multiples
    of 32), or None where the packed products cannot take it here. glu: w is a gate_up
    weight (gate rows, then up rows), packed in glu_order for products that end in SwiGLU
    (amx_product(glu=True))."""
    if (
        not packed_available()
        or w.dtype != torch.bfloat16
        or w.device.type != "cpu"
        or w.dim() != 2
        or w.shape[0] % 32
        or w.shape[1] % 32
    ):
        return None
    n, k = w.shape
    w = glu_order(w.detach()).contiguous() if glu else w.detach().contiguous()
    packed = torch.empty(n * k, dtype=torch.bfloat16)
    library().tw_amx_pack(ptr(w), n, k, ptr(packed), torch.get_num_threads())
    return packed


def amx_product(w: torch.Tensor, bias: torch.Tensor | None = None, packed=None, glu: bool = False):
    """x -> x @ w.T (+ bias) on packed weights (AMX tiles, or AVX-512 BF16 dot products
    where there are none), for bfloat16 w [N, K] (packed: amx_pack(w, glu) if already
    made), or None where that cannot run here. The result is bfloat16, summed in float32
    and rounded once, as torch's bfloat16 products are. glu: w is a gate_up weight [2I, K]
    and the result is SwiGLU's, silu(gate) * up [M, I], from the float32 sums."""
    packed = amx_pack(w, glu) if packed is None else packed
    if packed is None:
        return None
    lib = library()
    n, k = w.shape
    b = packed_bias(bias, glu)
    pw, pb = ptr(packed), ptr(b)  # kept alive by the closure below
    width, y_dtype = (n // 2, GLU) if glu else (n, BF16)

    def product(x: torch.Tensor) -> torch.Tensor:  # x: bfloat16 [M, K] on the CPU
        x = x if x.is_contiguous() else x.contiguous()
        y = torch.empty(x.shape[0], width, dtype=torch.bfloat16)
        threads = torch.get_num_threads()
        lib.tw_amx_linear(x.data_ptr(), x.shape[0], k, pw, n, pb, y.data_ptr(), y_dtype, threads)
        return y

    product.keep = (packed, b)
    return product


@functools.cache
def prefill_available() -> bool:
    """Whether prefill_attention runs here: on AMX tiles or AVX-512 BF16 dot products
    (asked of the library with an empty batch)."""
    lib = library()
    if lib is None:
        return False
    return lib.tw_prefill_attention(
        None, None, 1, 1, None, 0, None, None, None, None, None, 0, 1.0, None, 0,
        int(amx_available()), 1,
    ) == 0  # fmt: skip


def prefill_attention(
    q: torch.Tensor,  # [T, H, D] bfloat16, heads contiguous within a row (RoPE applied)
    k_pool: torch.Tensor,  # [slots, KVH, D] bfloat16, the chunks' own keys already written
    v_pool: torch.Tensor,
    seqs: list[tuple[int, int, torch.Tensor]],  # (first row, new rows, slots of every key)
    scale: float,
    out: torch.Tensor,  # [T, H * D] bfloat16, contiguous
    amx: bool | None = None,  # the products on AMX tiles (None: where they run)
) -> bool:
    """Causal attention of prompt chunks in C (tw_prefill_attention: on AMX tiles where
    they run, else with AVX-512 BF16 dot products), into the rows of out that belong to
    seqs; each sequence's keys are its context then its new rows. False, with nothing
    written, where the kernel cannot run: no C kernels, a CPU with neither AMX nor
    AVX-512 BF16, a head_dim other than 64, or tensors not laid out as above."""
    amx = amx_available() if amx is None else amx and amx_available()
    _, h, d = q.shape
    kvh = k_pool.shape[1]
    if (
        not seqs
        or library() is None
        or d != 64
        or h % kvh
        or q.dtype != torch.bfloat16
        or k_pool.dtype != torch.bfloat16
        or v_pool.dtype != torch.bfloat16
        or out.dtype != torch.bfloat16
        or q.device.type != "cpu"
        or q.stride(2) != 1
        or q.stride(1) != d
        or not (k_pool.is_contiguous() and v_pool.is_contiguous() and out.is_contiguous())
    ):
        return False
    starts = torch.tensor([s for s, _, _ in seqs], dtype=torch.long)
    rows = torch.tensor([n for _, n, _ in seqs], dtype=torch.long)
    keys = torch.tensor([len(x) for _, _, x in seqs], dtype=torch.long)
    slots = torch.cat([x.to(torch.long) for _, _, x in seqs]).contiguous()
    slot_start = torch.cumsum(keys, 0) - keys
    done = library().tw_prefill_attention(
        ptr(k_pool), ptr(v_pool), h, kvh, q.data_ptr(), q.stride(0), ptr(starts), ptr(rows),
        ptr(slots), ptr(slot_start), ptr(keys), len(seqs), scale, ptr(out), out.stride(0),
        int(amx), torch.get_num_threads(),
    )  # fmt: skip
    return done == 0


def argmax_rows(x: torch.Tensor) -> list[int]:
    """x.argmax(-1).tolist() for a 2-D tensor; in C for float32/bfloat16 on the CPU, where
    torch's argmax over [64, 49152] float32 logits takes about 3 ms against 0.2."""
    lib = library()
    if (
        lib is None
        or x.dim() != 2
        or x.device.type != "cpu"
        or x.dtype not in (torch.float32, torch.bfloat16)
        or x.shape[1] == 0
    ):
        return x.argmax(-1).tolist() if x.shape[0] else []
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.long)
    lib.tw_argmax_rows(
        ptr(x), DTYPE_CODES[x.dtype], x.shape[0], x.shape[1], ptr(out), torch.get_num_threads()
    )
    return out.tolist()
