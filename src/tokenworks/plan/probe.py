"""Measure this machine: the figures a roofline needs, from a few seconds of torch.

- decode bandwidth: a weight-streaming matrix-vector product (`torch.mv`, what a batch-1
  decode on torch's path runs, on a 128 MiB matrix), in bfloat16 and float32: bytes of
  the matrix per second. This, not a plain copy, is what bounds decode on a CPU;
- copy bandwidth: a large tensor copy (read + write), for reference;
- matmul rates: square products (2048 x 2048 by default, smaller where a product of that
  size would take long) in bfloat16 and float32, FLOP/s.
"""

from __future__ import annotations

import os
import time

from tokenworks.plan.hardware import Hardware
from tokenworks.units import MiB


def best_time(fn, repeats: int, budget: float = 2.0) -> float:
    """The fastest of `repeats` calls after a warm-up, stopping early once `budget`
    seconds are spent (a slow call is timed fewer times)."""
    fn()  # warm-up
    best, spent = float("inf"), 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        took = time.perf_counter() - t
        best, spent = min(best, took), spent + took
        if spent > budget:
            break
    return best


def _matmul_size(dtype, most: int) -> int:
    """The square size to time products of dtype at: `most`, or smaller where one product
    of it would take over 0.2 s (bfloat16 without native support computes at a fraction
    of float32's rate: 2048^3 would take a minute a product)."""
    import torch

    k = 256
    while k < most:
        a = torch.randn(k, k).to(dtype)
        t = time.perf_counter()
        a @ a
        if (time.perf_counter() - t) * 8 > 0.2:  # the next size takes 8 x as long
            break
        k *= 2
    return k


def probe(
    threads: int | None = None, matrix_mib: int = 128, matmul_size: int = 2048, repeats: int = 8
) -> Hardware:
    import torch

    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        out = {"threads": torch.get_num_threads()}
        with torch.inference_mode():
            for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
                elem = torch.tensor([], dtype=dtype).element_size()
                n = int((matrix_mib * MiB / elem) ** 0.5)
                w = torch.randn(n, n).to(dtype)
                x = torch.randn(n).to(dtype)
                t = best_time(lambda w=w, x=x: torch.mv(w, x), repeats)
                out[f"matvec_bandwidth_{name}"] = w.numel() * elem / t
                k = _matmul_size(dtype, matmul_size)
                a = torch.randn(k, k).to(dtype)
                b = torch.randn(k, k).to(dtype)
                t = best_time(lambda a=a, b=b: a @ b, repeats)
                out[f"matmul_flops_{name}"] = 2 * k**3 / t
                del w, x, a, b
            src = torch.empty(64 * MiB, dtype=torch.uint8)
            dst = torch.empty_like(src)
            t = best_time(lambda: dst.copy_(src), repeats)
            out["copy_bandwidth"] = 2 * src.numel() / t  # read + write
    finally:
        torch.set_num_threads(old)
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        memory = 16 * 2**30
    return Hardware(
        "this-cpu",
        memory,
        out["matvec_bandwidth_bf16"],
        {"bf16": out["matmul_flops_bf16"], "fp32": out["matmul_flops_fp32"]},
        kind="cpu",
        source=f"measured by tokenworks.plan.probe ({out['threads']} threads)",
        notes="bandwidth is a bf16 weight-streaming matrix-vector product (decode's shape)",
        measured=out,
    )


LINK_SIZES = (1 << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 22)  # bytes all-reduced


def _link_rank(rank: int, ranks: int, address: str, sizes, repeats: int, conn) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=ranks)
    try:
        best = []
        for n in sizes:
            x = torch.ones(n // 4)
            dist.all_reduce(x)  # the connection's first use pays for setting it up
            times = []
            for _ in range(repeats):
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_reduce(x)
                times.append(time.perf_counter() - t0)
            best.append(min(times))  # the least disturbed by the rest of the machine
        if rank == 0:
            conn.send_bytes(" ".join(map(repr, best)).encode())
    finally:
        dist.destroy_process_group()


def probe_link(ranks: int = 2, sizes=LINK_SIZES, repeats: int = 50) -> tuple[list, list]:
    """All-reduce times over gloo between `ranks` processes of this machine on 127.0.0.1,
    as (sizes in bytes, best seconds): what plan/parallel.fit_link turns into a link."""
    import multiprocessing
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    procs = [ctx.Process(target=_link_rank, args=(r, ranks, address, sizes, repeats, theirs))
             for r in range(ranks)]  # fmt: skip
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    if not ours.poll(0):
        raise RuntimeError("the gloo link probe's ranks did not report (see their errors above)")
    return list(sizes), [float(x) for x in ours.recv_bytes().decode().split()]
