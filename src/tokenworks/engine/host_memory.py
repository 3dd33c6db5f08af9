"""Keep freed host memory in the process, so that each step reuses the last step's pages.

A CPU step allocates its activations afresh (torch's CPU allocator caches nothing): a
2,048-token prefill step of SmolLM2-135M asks for about 25 MB a layer. glibc's malloc
serves big requests with mmap and gives them back to the kernel on free (or trims the top
of its heap), so the next step's buffers arrive as new pages, each zeroed by the kernel on
first touch: several percent of an offline run goes to page faults. With the thresholds
below the heap grows once to its peak and stays.

This is what vLLM's CPU guide gets from preloading tcmalloc and llama.cpp from allocating
its compute buffers once. The cost: the process keeps its peak heap (a few hundred MB for
a small model) instead of returning it between steps.

EngineConfig.keep_freed_memory (--no-keep-freed-memory) leaves malloc as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 1024**2  # glibc's largest: requests above it still map their own pages
TRIM_THRESHOLD = 1024**3  # free heap kept at its top before any goes back to the kernel

_done = False


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds once per process; True where they were set
    (Linux with glibc)."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other C libraries have no mallopt
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    _done = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    return _done


def release_freed_memory() -> None:
    """Give free heap pages back to the kernel now (glibc's malloc_trim): after a model is
    built, the float32 weights it was built from are free but, under the thresholds above,
    stay in the process (about 500 MB for the default model)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(ctypes.c_size_t(0))
    except (OSError, AttributeError):
        pass
