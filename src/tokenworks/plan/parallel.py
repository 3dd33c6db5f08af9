"""What splitting one model costs and buys: tensor and pipeline parallelism over a link.

A link is a bandwidth B (bytes/s, one direction) and a latency a (seconds a message
costs before its first byte). The collectives are the ring algorithms NCCL and gloo use
for large messages:

- all-reduce of n bytes over d ranks: 2(d - 1) steps, each sending n/d bytes:
  2(d - 1)(a + n / (d B));
- all-gather of n bytes in all (n/d from each rank): (d - 1)(a + n / (d B));
- a send of n bytes to the next stage: a + n / B.

Tensor parallelism (engine/workers.py, models/tensor_parallel.py) adds, every step, an
all-reduce of [tokens, hidden] after each row-parallel product (the output projection,
the down projection or the MoE layer: two a layer), one after the vocabulary-split
embedding, and an all-gather of the logits rows from the vocabulary-split head; in return
each rank reads 1/d of the weights and the KV cache and does 1/d of the FLOPs. Pipeline
parallelism sends [tokens, hidden] from each stage to the next, and the logits back to
rank 0; each stage holds 1/p of the layers, but a step still passes through all of them
in turn: with m micro-batches the stages overlap, and a step takes (m + p - 1) / m stage
times instead of p (GPipe's bubble), never less than one device's whole step.

Devices: "separate" ones each bring their own memory bandwidth and FLOPs (GPUs, or
machines); ranks that share one machine ("shared") share its bandwidth and cores, so
splitting saves no compute time there and the communication is all it adds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from tokenworks.plan.hardware import Hardware
from tokenworks.plan.models import ModelShape
from tokenworks.plan.quant import QuantScheme
from tokenworks.plan.roofline import decode, prefill


@dataclass(frozen=True)
class Link:
    name: str
    bandwidth: float  # bytes/s, one direction
    latency: float  # seconds per message
    source: str = ""


# typical figures (catalogue, not measured here): per direction, per device pair
LINKS = {
    "nvlink4": Link("NVLink 4 (H100 SXM)", 450e9, 3e-6, "900 GB/s both ways; NCCL latency"),
    "pcie4": Link("PCIe 4.0 x16", 25e9, 10e-6, "32 GB/s raw, about 25 usable"),
    "pcie5": Link("PCIe 5.0 x16", 50e9, 10e-6, "64 GB/s raw, about 50 usable"),
    "ib-ndr": Link("InfiniBand NDR 400 Gb/s", 50e9, 5e-6, "400 Gb/s per port"),
    "eth-100g": Link("Ethernet 100 Gb/s", 12.5e9, 20e-6, "TCP, one stream"),
    "eth-10g": Link("Ethernet 10 Gb/s", 1.25e9, 50e-6, "TCP, one stream"),
}


def get_link(name: str) -> Link:
    if name not in LINKS:
        raise ValueError(f"unknown link {name!r}; known: {', '.join(LINKS)}, or measured")
    return LINKS[name]


def allreduce_time(nbytes: float, ranks: int, link: Link) -> float:
    if ranks == 1:
        return 0.0
    return 2 * (ranks - 1) * (link.latency + nbytes / (ranks * link.bandwidth))


def allgather_time(nbytes: float, ranks: int, link: Link) -> float:
    """nbytes: the gathered whole (nbytes / ranks from each)."""
    if ranks == 1:
        return 0.0
    return (ranks - 1) * (link.latency + nbytes / (ranks * link.bandwidth))


def send_time(nbytes: float, link: Link) -> float:
    return link.latency + nbytes / link.bandwidth


@dataclass(frozen=True)
class Traffic:
    """The messages of one step: how many, and the bytes each carries."""

    allreduces: int = 0
    allreduce_bytes: float = 0.0  # each
    allgathers: int = 0
    allgather_bytes: float = 0.0  # each, the gathered whole
    sends: int = 0
    send_bytes: float = 0.0  # in all

    @property
    def total_bytes(self) -> float:
        return (
            self.allreduces * self.allreduce_bytes
            + self.allgathers * self.allgather_bytes
            + self.send_bytes
        )


def tensor_traffic(model: ModelShape, tokens: int, rows: int, act_bytes: float) -> Traffic:
    """A tensor-parallel step of `tokens` tokens, `rows` of them wanting logits: two
    all-reduces a layer and the embedding's, and the head's all-gather."""
    return Traffic(
        allreduces=2 * model.n_layers + 1,
        allreduce_bytes=tokens * model.hidden * act_bytes,
        allgathers=1,
        allgather_bytes=rows * model.vocab * act_bytes,
    )


def pipeline_traffic(
    model: ModelShape, tokens: int, rows: int, stages: int, act_bytes: float, micro: int = 1
) -> Traffic:
    """A pipelined step in `micro` micro-batches: each one's hidden states across every
    stage boundary, and its logits back to rank 0."""
    if stages == 1:
        return Traffic()
    hidden = (stages - 1) * tokens * model.hidden * act_bytes
    return Traffic(sends=stages * micro, send_bytes=hidden + rows * model.vocab * act_bytes)


def tensor_seconds(t: Traffic, ranks: int, link: Link) -> dict:
    """The time of a tensor-parallel step's collectives, by kind."""
    return {
        "all_reduce": t.allreduces * allreduce_time(t.allreduce_bytes, ranks, link),
        "all_gather": t.allgathers * allgather_time(t.allgather_bytes, ranks, link),
    }


def pipeline_seconds(
    model: ModelShape, tokens: int, rows: int, stages: int, act_bytes: float, micro: int,
    link: Link,
) -> float:  # fmt: skip
    """The sends a pipelined step waits for: the last micro-batch's across each boundary
    (the earlier ones overlap the next micro-batch's compute), and the logits back."""
    hidden = send_time(tokens / micro * model.hidden * act_bytes, link)
    return (stages - 1) * hidden + send_time(rows * model.vocab * act_bytes, link)


@dataclass
class Split:
    strategy: str
    tp: int
    pp: int
    phase: str
    tokens: int
    compute_s: float  # the step's compute and memory time, split as the strategy splits it
    comm_s: float
    step_s: float
    speedup: float  # one device's step over this one
    bytes_per_step: float
    bytes_per_token: float
    messages: int
    pays: bool

    def to_dict(self) -> dict:
        return asdict(self)


def split_step(
    model: ModelShape,
    hw: Hardware,
    scheme: QuantScheme,
    link: Link,
    tp: int = 1,
    pp: int = 1,
    phase: str = "decode",
    batch: int = 1,
    context: int = 1024,
    prompt: int = 512,
    micro_batches: int | None = None,
    act_bytes: float = 2.0,
    devices: str = "separate",
    compute_dtype: str = "bf16",
) -> Split:
    """One step split tp x pp ways: its compute (the roofline's step time, divided where
    the devices are separate), its communication over `link`, and whether it beats one
    device. micro_batches: the pipeline's (default: the stages, or the batch if fewer)."""
    if devices not in ("separate", "shared"):
        raise ValueError(f"devices {devices!r}: expected separate or shared")
    if phase == "decode":
        one = decode(model, hw, scheme, batch=batch, context=context, compute_dtype=compute_dtype)
        tokens, rows = batch, batch
    else:
        one = prefill(model, hw, scheme, prompt=prompt, compute_dtype=compute_dtype)
        tokens, rows, batch = prompt, 1, 1
    m = max(1, min(micro_batches or pp, batch))
    t_one = one.step_time_s
    if devices == "separate":  # 1/tp of the work a device, 1/pp of the layers a stage
        compute = t_one / tp / pp * (m + pp - 1) / m
    else:  # one machine's bandwidth and cores, however the work is cut
        compute = t_one
    comm = 0.0
    traffic = []
    if tp > 1:
        traffic.append(tensor_traffic(model, tokens, rows, act_bytes))
        comm += sum(tensor_seconds(traffic[-1], tp, link).values())
    if pp > 1:
        traffic.append(pipeline_traffic(model, tokens, rows, pp, act_bytes, m))
        comm += pipeline_seconds(model, tokens, rows, pp, act_bytes, m, link)
    moved = sum(t.total_bytes for t in traffic)
    messages = sum(t.allreduces + t.allgathers + t.sends for t in traffic)
    step = compute + comm
    name = "one device" if tp * pp == 1 else f"tp {tp} x pp {pp}"
    return Split(
        strategy=name, tp=tp, pp=pp, phase=phase, tokens=tokens, compute_s=compute, comm_s=comm,
        step_s=step, speedup=t_one / step, bytes_per_step=moved, bytes_per_token=moved / tokens,
        messages=messages, pays=step < t_one,
    )  # fmt: skip


def fit_link(sizes: list[int], seconds: list[float], ranks: int = 2) -> Link:
    """The link that explains measured all-reduce times (least squares of the ring model:
    t = 2(d - 1) a + 2(d - 1) n / (d B), linear in a and 1/B)."""
    if len(sizes) < 2:
        raise ValueError("fitting a link takes all-reduce times at two sizes or more")
    xs = [2 * (ranks - 1) * n / ranks for n in sizes]
    c = 2 * (ranks - 1)
    mean_x = sum(xs) / len(xs)
    mean_t = sum(seconds) / len(seconds)
    sxx = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (t - mean_t) for x, t in zip(xs, seconds, strict=True)) / sxx
    intercept = mean_t - slope * mean_x
    return Link(
        "measured",
        bandwidth=1 / slope if slope > 0 else float("inf"),
        latency=max(intercept / c, 0.0),
        source=f"gloo all-reduce over {ranks} ranks, {len(sizes)} sizes",
    )
