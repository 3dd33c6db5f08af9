"""The C kernels' source compiles for every x86-64 CPU level, whatever CPU runs the tests.

The file once compiled only where the CPU had AMX (a type the decode step needs was
declared inside the AMX section), so on an AVX-512 CPU without AMX every C path was
silently off. test_paged_kernel's test_the_kernel_builds_here fails where the build fails
on this machine; this compiles the other CPUs' branches too."""

from __future__ import annotations

import platform
import subprocess

import pytest

from tokenworks.kernels import build

CC = build.compiler()

# From no vector extensions at all to AVX-512 with BF16 and AMX: each #if branch of
# decode.c is compiled by one of these.
LEVELS = ["x86-64", "x86-64-v2", "x86-64-v3", "x86-64-v4", "cooperlake", "sapphirerapids"]


@pytest.mark.skipif(
    CC is None or platform.machine() not in ("x86_64", "AMD64"),
    reason="needs a C compiler targeting x86-64",
)
@pytest.mark.parametrize("march", LEVELS)
def test_the_source_compiles_for_every_cpu_level(march, tmp_path):
    # -O1: a level's intrinsics and declarations fail to compile as at -O3, in a third of
    # the time (this machine's own build, at -O3, is test_paged_kernel's)
    swap = {"-march=native": f"-march={march}", "-O3": "-O1"}
    flags = [swap.get(f, f) for f in build.FLAGS]
    probe = subprocess.run([CC, f"-march={march}", "-x", "c", "-E", "-"], input="",
                           capture_output=True, text=True)  # fmt: skip
    if probe.returncode != 0:
        pytest.skip(f"{CC} does not know -march={march}")
    run = subprocess.run(
        [CC, *flags, "-Werror=implicit-function-declaration", str(build.SOURCE),
         "-o", str(tmp_path / "decode.so"), "-lm"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
