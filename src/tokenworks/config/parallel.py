"""How one engine spreads over processes and machines: tensor and pipeline parallel sizes,
where the ranks run, and where they meet."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenworks.options import option

DISTRIBUTED = "distributed"
EXECUTOR_BACKENDS = ("mp", "ray")  # where engine cores and worker ranks run


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = field(
        default=1,
        metadata=option(
            "split each layer's heads and MLP width (and the vocabulary) over N processes "
            "joined by torch.distributed (gloo on the CPU, NCCL on CUDA), each holding its "
            "shard (models/tensor_parallel.py; runs the torch modules)",
            group=DISTRIBUTED,
            metavar="N",
        ),
    )
    pipeline_parallel_size: int = field(
        default=1,
        metadata=option(
            "cut the layers into N stages, one group of processes each (times the tensor-"
            "parallel size), a batch in flight for each stage (see --pipeline-batches; "
            "models/pipeline.py; runs the torch modules)",
            group=DISTRIBUTED,
            metavar="N",
        ),
    )
    pipeline_batches: int | None = field(
        default=None,
        metadata=option(
            "batches a pipeline keeps in flight: the next starts through the first stage "
            "while the later stages finish the last, each taking its share of the running "
            "sequences (default: one per stage; 1: one batch at a time, cut into a micro-"
            "batch for each stage)",
            group=DISTRIBUTED,
            metavar="N",
        ),
    )
    distributed_timeout: float = field(
        default=60.0,
        metadata=option(
            "seconds a collective waits for another rank before the step fails (and with it "
            "the engine: a rank that died or hangs fails its requests, never hangs them)",
            group=DISTRIBUTED,
        ),
    )
    distributed_executor_backend: str = field(
        default="mp",
        metadata=option(
            "where serve's engine cores and the worker ranks run: mp, local processes; ray, "
            "Ray actors placed on the cluster RAY_ADDRESS names (or a local one), each taking "
            "--threads CPUs (needs pip install 'tokenworks[ray]')",
            group=DISTRIBUTED,
            choices=EXECUTOR_BACKENDS,
        ),
    )
    nnodes: int = field(
        default=1,
        metadata=option(
            "machines the ranks span (torchrun's name), each running the same command with "
            "its own --node-rank; node 0 serves, the others run their share of the ranks",
            group=DISTRIBUTED,
            metavar="N",
        ),
    )
    node_rank: int = field(
        default=0,
        metadata=option(
            "this machine's place among --nnodes: 0 runs the engine (and its first ranks), "
            "k > 0 runs ranks k x world/nnodes onwards, taking its steps from node 0",
            group=DISTRIBUTED,
            metavar="K",
        ),
    )
    master_addr: str = field(
        default="127.0.0.1",
        metadata=option(
            "with --nnodes above 1: node 0's address, where every rank meets "
            "(torch.distributed's TCP store on --master-port, the steps on the port after)",
            group=DISTRIBUTED,
            metavar="HOST",
        ),
    )
    master_port: int = field(
        default=29500,
        metadata=option(
            "with --nnodes above 1: node 0's rendezvous port (torchrun's default); the "
            "steps travel on the next port",
            group=DISTRIBUTED,
            metavar="PORT",
        ),
    )

    def __post_init__(self) -> None:
        self.check_parallel()

    @property
    def ranks(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def check_parallel(self) -> None:
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ValueError("tensor_parallel_size and pipeline_parallel_size must be >= 1")
        if self.pipeline_batches is not None and self.pipeline_batches < 1:
            raise ValueError("pipeline_batches must be >= 1 (or unset: one per stage)")
        if self.distributed_timeout <= 0:
            raise ValueError("distributed_timeout (seconds) must be > 0")
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(
                f"distributed_executor_backend {self.distributed_executor_backend!r}: expected "
                f"one of {', '.join(EXECUTOR_BACKENDS)}"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"node_rank {self.node_rank} with nnodes {self.nnodes}: give a node rank from "
                f"0 to {self.nnodes - 1} (and nnodes >= 1)"
            )
        if self.nnodes > 1 and self.ranks % self.nnodes:
            raise ValueError(
                f"nnodes {self.nnodes} does not divide the {self.ranks} ranks (tensor "
                f"{self.tensor_parallel_size} x pipeline {self.pipeline_parallel_size}): "
                "every node runs the same number of them"
            )
        if self.nnodes > 1 and self.distributed_executor_backend == "ray":
            raise ValueError(
                "with distributed_executor_backend ray, Ray places the ranks on its "
                "nodes: leave out nnodes and node_rank"
            )
