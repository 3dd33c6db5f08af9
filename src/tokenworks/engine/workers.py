"""Tensor-parallel workers under one engine.

Rank 0 is the engine's own process: it schedules, samples and holds the first shard. Ranks
1 .. size-1 are processes it spawns; each reads the model, keeps its shard
(models/tensor_parallel.py), makes its own KV pool of the same blocks over its own heads,
and then runs every step it is sent. A step travels as the runner's TorchStep (msgpack
over a pipe, no pickle); every rank then runs the same forward on the same batch, and the
collectives inside the forward (torch.distributed: gloo on the CPU, NCCL on CUDA) join
them. The block tables are rank 0's alone: a worker's pool is laid out the same, so a
block number means the same slots on every rank.

A worker waits for its next step on the pipe, not in a collective, so an idle engine
never times out. A worker that dies is seen at the next step (its process has exited) or
inside one (the collective fails, within --distributed-timeout): the step fails its
requests, and every later step fails at once with the same reason.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import multiprocessing
import os
import socket

import msgspec
import torch
import torch.distributed as dist

from tokenworks.engine.kv_groups import KVLayout
from tokenworks.engine.runner import ModelRunner, TorchStep
from tokenworks.models import tensor_parallel as tp
from tokenworks.models.build import build_model

log = logging.getLogger("tokenworks.engine")

STEP, DISCARD, STOP = b"s", b"d", b"q"


class WorkerFailed(RuntimeError):
    """A tensor-parallel rank died or failed; the engine cannot run another step."""


def rank_device(config, rank: int) -> str:
    """Rank r's device: the config's on the CPU, cuda:r on CUDA (one GPU a rank)."""
    return config.device if config.device == "cpu" else f"cuda:{rank}"


def rank_threads(config) -> int | None:
    """CPU threads each rank takes: the config's, or the cores shared out between ranks."""
    if config.threads is not None or config.tensor_parallel_size == 1:
        return config.threads
    return max(1, (os.cpu_count() or 1) // config.tensor_parallel_size)


def build_rank_model(config, loaded, quantization, rank: int = 0):
    """(the model this rank runs, its spec): the whole model, or with
    tensor_parallel_size > 1 its shard wrapped with the collectives."""
    size = config.tensor_parallel_size
    spec, weights = loaded.spec, loaded.weights
    if size > 1:
        spec = tp.shard_spec(loaded.spec, size)
        weights = tp.shard_weights(loaded.weights, loaded.spec, tp.Shard(rank, size))
    model = build_model(
        spec,
        weights,
        config.torch_dtype,
        rank_device(config, rank),
        quantization,
        False,  # torch's invariant tiles only where the C kernels cannot: engine._open_kernels
        config.dense_from_rows,
        config.moe_strategy,
        config.moe_capacity_factor,
        config.attention_tile,
    )
    if size > 1:
        tp.parallelize_(model, loaded.spec, tp.Shard(rank, size))
    return model, spec


def _init_group(config, rank: int, address: str) -> None:
    backend = "gloo" if config.device == "cpu" else "nccl"
    dist.init_process_group(
        backend,
        init_method=address,
        rank=rank,
        world_size=config.tensor_parallel_size,
        timeout=datetime.timedelta(seconds=config.distributed_timeout),
    )


def _worker_main(rank, address, config_json, num_blocks, conn) -> None:
    """A worker rank: build the shard and its pool, say ready, run steps until told to
    stop (or until rank 0's end of the pipe closes: its process is gone)."""
    from tokenworks.config import EngineConfig
    from tokenworks.engine.kv_cache import KVPool
    from tokenworks.models.loader import load

    try:
        config = EngineConfig.build(**json.loads(config_json))
        if rank_threads(config):
            torch.set_num_threads(rank_threads(config))
        _init_group(config, rank, address)
        loaded = load(config.model, keep_index=False)
        quantization = config.resolved_quantization(loaded.gguf_index is not None)
        model, spec = build_rank_model(config, loaded, quantization, rank)
        del loaded
        layout = KVLayout.for_spec(spec, config.sliding_window_kv == "free")
        device = rank_device(config, rank)
        bs = config.block_size
        pool = KVPool.for_spec(spec, num_blocks, bs, config.torch_dtype, device, layout)
        runner = ModelRunner(model, pool, bs, device)
    except Exception as e:  # said to rank 0, which refuses to start with it
        conn.send_bytes(f"{type(e).__name__}: {e}".encode())
        raise
    conn.send_bytes(b"")
    while True:
        try:
            data = conn.recv_bytes()
        except EOFError:
            break
        kind, body = data[:1], data[1:]
        if kind == STOP:
            break
        if kind == DISCARD:
            pool.discard()
            continue
        runner.execute(msgspec.msgpack.decode(body, type=TorchStep))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class TensorWorkers:
    """Rank 0's side: the worker processes and a pipe to each."""

    procs: list
    conns: list
    failed: str | None = None

    @classmethod
    def start(cls, config, num_blocks: int, ready_timeout: float = 3600.0) -> TensorWorkers:
        """Spawn ranks 1.., join the process group as rank 0, and wait until every worker
        has built its shard; a worker that fails to start stops them all, with its error."""
        if dist.is_initialized():
            raise RuntimeError("a torch.distributed group is already open in this process")
        address = f"tcp://127.0.0.1:{_free_port()}"
        ctx = multiprocessing.get_context("spawn")
        text = json.dumps(config.to_dict() | {"speculative_config": None})
        procs, conns = [], []
        for rank in range(1, config.tensor_parallel_size):
            ours, theirs = ctx.Pipe()
            p = ctx.Process(target=_worker_main, args=(rank, address, text, num_blocks, theirs),
                            name=f"tokenworks-tp{rank}", daemon=True)  # fmt: skip
            p.start()
            theirs.close()
            procs.append(p)
            conns.append(ours)
        workers = cls(procs, conns)
        try:
            _init_group(config, 0, address)
            for rank, conn in enumerate(conns, 1):
                if not conn.poll(ready_timeout):
                    raise WorkerFailed(f"tensor-parallel rank {rank} did not start in time")
                said = conn.recv_bytes().decode()
                if said:
                    raise WorkerFailed(f"tensor-parallel rank {rank} failed to start: {said}")
        except Exception as e:
            workers.stop()
            if isinstance(e, EOFError):
                raise WorkerFailed("a tensor-parallel rank exited while starting") from e
            raise
        log.info("tensor parallel: %d ranks over %s", config.tensor_parallel_size, address)
        return workers

    def check(self) -> None:
        """Raise if a worker has failed or exited."""
        if self.failed is None:
            for rank, p in enumerate(self.procs, 1):
                if not p.is_alive():
                    self.failed = f"tensor-parallel rank {rank} exited (code {p.exitcode})"
        if self.failed is not None:
            raise WorkerFailed(self.failed)

    def send(self, step: TorchStep) -> None:
        self._say(STEP + msgspec.msgpack.encode(step))

    def discard(self) -> None:
        self._say(DISCARD)

    def _say(self, data: bytes) -> None:
        self.check()
        try:
            for conn in self.conns:
                conn.send_bytes(data)
        except OSError as e:
            self.failed = f"a tensor-parallel rank is gone ({e})"
            raise WorkerFailed(self.failed) from e

    def fail(self, error: BaseException) -> WorkerFailed:
        """A step raised while the ranks ran it: the group is broken from here on (the
        others wait in a collective this rank left); the error to raise for it."""
        if self.failed is None:
            self.failed = f"a tensor-parallel step failed: {error}"
        return WorkerFailed(self.failed)

    def stop(self, timeout: float = 10.0) -> None:
        """Tell every worker to stop, wait for them, and leave the group."""
        for conn in self.conns:
            try:
                conn.send_bytes(STOP)
                conn.close()
            except OSError:
                pass
        for p in self.procs:
            p.join(timeout)
            if p.is_alive():
                p.kill()
                p.join()
        self.conns = []
        if dist.is_initialized():
            dist.destroy_process_group()
