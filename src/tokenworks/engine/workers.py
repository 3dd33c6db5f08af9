"""The worker ranks under one engine: tensor and pipeline parallelism.

Rank 0 is the engine's own process: it schedules, samples and holds the first part of the
model. Ranks 1 .. world-1 are processes it spawns; each joins the process group, reads the
model, keeps its part (its pipeline stage's layers, its tensor-parallel shard of them:
models/pipeline.py, models/tensor_parallel.py), makes its own KV pool of the same blocks,
and then runs every step it is sent. A step travels as the runner's TorchStep (msgpack over
a pipe, no pickle); every rank runs the same forward on the same batch, and the collectives
and sends inside it (torch.distributed: gloo on the CPU, NCCL on CUDA) join them. The block
tables are rank 0's alone: every pool is laid out the same, so a block number means the
same slots on every rank.

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
from tokenworks.models.pipeline import PipelineStage, Topology, stage_layers, stage_weights

log = logging.getLogger("tokenworks.engine")

STEP, DISCARD, STOP = b"s", b"d", b"q"


class WorkerFailed(RuntimeError):
    """A worker rank died or failed; the engine cannot run another step."""


def rank_device(config, rank: int) -> str:
    """Rank r's device: the config's on the CPU, cuda:r on CUDA (one GPU a rank)."""
    return config.device if config.device == "cpu" else f"cuda:{rank}"


def world_size(config) -> int:
    return config.tensor_parallel_size * config.pipeline_parallel_size


def rank_threads(config) -> int | None:
    """CPU threads each rank takes: the config's, or the cores shared out between ranks."""
    if config.threads is not None or world_size(config) == 1:
        return config.threads
    return max(1, (os.cpu_count() or 1) // world_size(config))


def rank_quantization(config, gguf_file: bool) -> str | None:
    """What the weights run as (config.resolved_quantization), except that a GGUF's blocks
    are dequantised where tensor parallelism slices them (a shard's rows are floats)."""
    q = config.resolved_quantization(gguf_file)
    return None if q == "gguf" and config.tensor_parallel_size > 1 else q


def check_split(spec, config) -> None:
    """Raise, saying what to change, where the model cannot be split as configured (before
    any worker is started)."""
    if config.tensor_parallel_size > 1:
        tp.check_divisible(spec, config.tensor_parallel_size)
    if config.pipeline_parallel_size > 1:
        if spec.arch == "gpt2" or spec.mla is not None:
            raise ValueError(
                f"pipeline parallelism runs Llama-shaped models; {spec.arch} is not one"
            )
        stage_layers(spec.n_layers, config.pipeline_parallel_size)


def join(config, rank: int, address: str) -> Topology:
    """Join the ranks' process group (and each pipeline stage's tensor-parallel group:
    every rank makes every group, in the same order, as torch.distributed asks)."""
    tensor, stages = config.tensor_parallel_size, config.pipeline_parallel_size
    dist.init_process_group(
        "gloo" if config.device == "cpu" else "nccl",
        init_method=address,
        rank=rank,
        world_size=tensor * stages,
        timeout=datetime.timedelta(seconds=config.distributed_timeout),
    )
    groups = [dist.new_group(list(range(s * tensor, (s + 1) * tensor))) if tensor > 1 else None
              for s in range(stages)]  # fmt: skip
    return Topology(rank, tensor, stages, groups[rank // tensor])


def build_rank_model(config, loaded, quantization, topology: Topology | None = None):
    """(the model this rank runs, its spec): the whole model; or its pipeline stage's
    layers, split over the stage's tensor-parallel ranks and wrapped with the collectives
    (models/tensor_parallel.py, models/pipeline.py)."""
    top = topology or Topology(0)
    spec, weights = loaded.spec, loaded.weights
    layers = stage_layers(spec.n_layers, top.pp)[top.stage] if top.pp > 1 else None
    if layers is not None:
        weights = stage_weights(weights, layers)
    shard = tp.Shard(top.tp_rank, top.tp, top.tp_group)
    if top.tp > 1:
        spec = tp.shard_spec(loaded.spec, top.tp, top.tp_rank)
        weights = tp.shard_weights(weights, loaded.spec, shard)
    model = build_model(
        spec,
        weights,
        config.torch_dtype,
        rank_device(config, top.rank),
        quantization,
        False,  # torch's invariant tiles only where the C kernels cannot: engine._open_kernels
        config.dense_from_rows,
        config.moe_strategy,
        config.moe_capacity_factor,
        config.attention_tile,
        layers,
    )
    if top.tp > 1:
        tp.parallelize_(model, loaded.spec, shard)
    if top.pp > 1:
        model = PipelineStage(model, top, loaded.spec.vocab_size)
    return model, spec


def comms_of(model) -> list:
    """The message counters of this rank's part of the model (models.tensor_parallel
    Comms): its tensor-parallel group's, and its pipeline stage's."""
    found = {id(m.shard.comms): m.shard.comms for m in model.modules() if hasattr(m, "shard")}
    if isinstance(model, PipelineStage):
        found[id(model.comms)] = model.comms
    return list(found.values())


def _worker_main(rank, address, config_json, conn) -> None:
    """A worker rank: join the group, build its part of the model, take the pool's size,
    say ready, then run steps until told to stop (or until rank 0's end of the pipe
    closes: its process is gone)."""
    from tokenworks.config import EngineConfig
    from tokenworks.engine.kv_cache import KVPool
    from tokenworks.models.loader import load

    try:
        config = EngineConfig.build(**json.loads(config_json))
        if rank_threads(config):
            torch.set_num_threads(rank_threads(config))
        topology = join(config, rank, address)
        loaded = load(config.model, keep_index=False)
        quantization = rank_quantization(config, loaded.gguf_index is not None)
        model, spec = build_rank_model(config, loaded, quantization, topology)
        del loaded
        num_blocks = int(conn.recv_bytes())
        layout = KVLayout.for_spec(spec, config.sliding_window_kv == "free")
        device, bs = rank_device(config, rank), config.block_size
        pool = KVPool.for_spec(spec, num_blocks, bs, config.torch_dtype, device, layout)
        runner = ModelRunner(model, pool, bs, device, micro_batches=config.pipeline_parallel_size)
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
class WorkerRanks:
    """Rank 0's side: the worker processes and a pipe to each."""

    procs: list
    conns: list
    failed: str | None = None
    stopped: bool = False

    @classmethod
    def start(cls, config) -> tuple[WorkerRanks, Topology]:
        """Spawn ranks 1.., and join the process group with them as rank 0; each worker
        goes on to read the model and build its part (ready() waits for that)."""
        if dist.is_initialized():
            raise RuntimeError(
                "a torch.distributed group is already open in this process (another engine "
                "with worker ranks: close() it first)"
            )
        address = f"tcp://127.0.0.1:{_free_port()}"
        ctx = multiprocessing.get_context("spawn")
        # (a speculative drafter runs on rank 0 alone: the workers never see one)
        text = json.dumps(config.to_dict() | {"speculative_config": None})
        procs, conns = [], []
        for rank in range(1, world_size(config)):
            ours, theirs = ctx.Pipe()
            p = ctx.Process(target=_worker_main, args=(rank, address, text, theirs),
                            name=f"tokenworks-rank{rank}", daemon=True)  # fmt: skip
            p.start()
            theirs.close()
            procs.append(p)
            conns.append(ours)
        workers = cls(procs, conns)
        try:
            topology = join(config, 0, address)
        except Exception:
            workers.stop()
            raise
        log.info("%d ranks (tensor %d x pipeline %d) over %s", world_size(config),
                 config.tensor_parallel_size, config.pipeline_parallel_size, address)  # fmt: skip
        return workers, topology

    def ready(self, num_blocks: int, timeout: float = 3600.0) -> None:
        """Give every worker the pool's size, and wait until each has built its part; a
        worker that fails to start stops them all, with its error."""
        try:
            for conn in self.conns:
                conn.send_bytes(str(num_blocks).encode())
            for rank, conn in enumerate(self.conns, 1):
                if not conn.poll(timeout):
                    raise WorkerFailed(f"rank {rank} did not start in {timeout:.0f} s")
                said = conn.recv_bytes().decode()
                if said:
                    raise WorkerFailed(f"rank {rank} failed to start: {said}")
        except (OSError, EOFError) as e:
            self.stop()
            raise WorkerFailed("a worker rank exited while starting") from e
        except Exception:
            self.stop()
            raise

    def check(self) -> None:
        """Raise if a worker has failed or exited."""
        if self.failed is None:
            for rank, p in enumerate(self.procs, 1):
                if not p.is_alive():
                    self.failed = f"worker rank {rank} exited (code {p.exitcode})"
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
            self.failed = f"a worker rank is gone ({e})"
            raise WorkerFailed(self.failed) from e

    def fail(self, error: BaseException) -> WorkerFailed:
        """A step raised while the ranks ran it: the group is broken from here on (the
        others wait in a collective this rank left); the error to raise for it."""
        if self.failed is None:
            self.failed = f"a step across the worker ranks failed: {error}"
        return WorkerFailed(self.failed)

    def stop(self, timeout: float = 10.0) -> None:
        """Tell every worker to stop, wait for them, and leave the group (once: a later
        call, such as the engine's finaliser after close(), does nothing)."""
        if self.stopped:
            return
        self.stopped = True
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
