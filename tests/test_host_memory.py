"""engine/host_memory: freed activations stay in the process instead of being faulted back."""

import resource
import sys

import pytest
import torch

from tokenworks.engine.host_memory import keep_freed_memory


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_step_sized_buffer_is_reused_without_page_faults():
    assert keep_freed_memory()
    assert keep_freed_memory()  # idempotent
    size = 12 * 1024**2  # a prefill step's gate_up output, 2,048 x 3,072 bfloat16
    for _ in range(3):  # the heap grows to its peak (once or twice, as it fragments)
        torch.empty(size, dtype=torch.uint8).fill_(1)
    before = _faults()
    for _ in range(10):
        torch.empty(size, dtype=torch.uint8).fill_(1)  # freed at once, like a step's buffers
    # glibc's default maps or trims most of them afresh: about 20,000 faults for the ten
    assert _faults() - before < size // 4096  # fewer than one buffer's pages in all
