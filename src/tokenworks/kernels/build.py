"""Build csrc/ with the system C compiler and load it with ctypes.

The first use compiles csrc/kernels.c for this machine (`cc -O3 -march=native -fopenmp`,
about a second) into `$TOKENWORKS_HOME/kernels/`, named by a hash of the sources, the
flags and the CPU, so an edit, a new flag or another CPU builds afresh and a cached build
is never used where it was not made. No torch headers are involved: tensors are passed as
raw pointers. OpenMP comes from the libgomp torch has already loaded, so the kernels and
torch share one thread pool.
"""

from __future__ import annotations

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

from tokenworks import environment
from tokenworks.kernels.abi import SIGNATURES
from tokenworks.paths import home

log = logging.getLogger("tokenworks.kernels")
CSRC = Path(__file__).parent / "csrc"
SOURCE = CSRC / "kernels.c"  # the one translation unit; it includes the other files
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]


def sources() -> list[Path]:
    """Every file of the C source: kernels.c and the stages it includes."""
    return sorted(CSRC.glob("*.[ch]"))


def cpu_tag() -> str:
    """What -march=native depends on: the CPU model and its feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        keep = [x for x in lines if x.startswith(("model name", "flags"))][:2]
        return "\n".join(keep)
    except OSError:
        return platform.processor() or platform.machine()


def compiler() -> str | None:
    """The C compiler the kernels are built with: $CC, else cc, else gcc (None: none)."""
    return environment.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(cc: str, flags: list[str] = FLAGS) -> Path:
    """The shared library for this source, compiler, flags and CPU (built if not cached)."""
    digest = hashlib.sha256()
    for path in sources():
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update("\0".join([cc, *flags, cpu_tag()]).encode())
    target = home() / "kernels" / f"kernels-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        run = subprocess.run(
            [cc, *flags, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True
        )
        if run.returncode != 0:
            raise RuntimeError(f"{cc} failed:\n{run.stderr.strip()}")
        os.replace(tmp, target)  # atomic: concurrent builders never see half a file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def load() -> tuple[ctypes.CDLL | None, str]:
    """(the loaded library, "") or (None, why it cannot be built or loaded here)."""
    if not SOURCE.exists():
        return None, f"the C source {SOURCE} is missing from this installation"
    cc = compiler()
    if cc is None:
        return None, "no C compiler (cc, gcc or $CC) on this machine"
    try:
        return opened(build(cc)), ""
    except (OSError, RuntimeError) as e:
        return None, f"the build failed: {e}"


def opened(path: Path) -> ctypes.CDLL:
    """A built library, loaded, its functions given their signatures and the grid formats'
    tables."""
    lib = ctypes.CDLL(str(path))
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    lib.tw_set_grids(*(t.ctypes.data for t in grids()))
    return lib


@functools.cache
def grids() -> tuple:
    """The lattices of IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S and IQ1_S (IQ1_M's too) as
    int8 [points, values], and the 128 sign bytes they index: the gguf package's tables of
    the formats, kept here for as long as the process runs (the C kernels point at them)."""
    import gguf.quants as q
    import numpy as np

    out = []
    for cls in (q.IQ2_XXS, q.IQ2_XS, q.IQ2_S, q.IQ3_XXS, q.IQ3_S, q.IQ1_S):
        cls.init_grid()
        out.append(np.ascontiguousarray(cls.grid.reshape(cls.grid_shape), dtype=np.int8))
    out.append(np.frombuffer(q.IQ2_XXS.ksigns, dtype=np.uint8).copy())
    return tuple(out)


def variant(*extra_flags: str) -> ctypes.CDLL:
    """The kernels built with extra flags (e.g. -mno-avx512vnni: the paths CPUs without an
    instruction set take), beside the default build; for tests."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or $CC) on this machine")
    return opened(build(cc, [*FLAGS, *extra_flags]))


def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None where they cannot be built here (see `unavailable`)."""
    return load()[0]


def unavailable() -> str:
    """Why the kernels cannot run here ("" where they can)."""
    return load()[1]
