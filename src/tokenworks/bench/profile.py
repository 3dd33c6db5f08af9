"""`tokenworks profile`: one prompt pass and one decode step, component by component.

For each component (embedding, each projection, attention, norms and residuals, the MLP's
activation or the experts, the LM head, sampling, and the engine's own scheduling) it
gives the FLOPs and bytes its shapes imply, the time it took, the GFLOP/s and GB/s that
makes, and the share of the roofline (max(bytes / bandwidth, FLOPs / peak), this
machine's probed rates) that time reaches.

Timing: forward hooks on the model's modules stamp the clock at each boundary (after a
synchronise on CUDA, so a stamp is when the device finished, not when Python queued the
work: the book's chapter 7); each span between two stamps belongs to one component (the
product a pair of stamps brackets, attention between the QKV product's end and the output
projection's start, and so on). The spans tile the step, so they sum to the hooked step's
time; that sum is set beside the same step timed without hooks. The torch modules are
profiled (--kernels torch): the C kernels' whole step is one call with no boundaries.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from dataclasses import dataclass, field

import torch

from tokenworks.bench.compiled import timed_step
from tokenworks.engine.loop import EngineLoop
from tokenworks.shapes import ModelShape

PRODUCTS = {  # module attribute -> component
    "qkv": "qkv_proj", "o_proj": "o_proj", "gate_up": "gate_up_proj", "down": "down_proj",
    "lm_head": "lm_head", "moe": "experts", "mla": "latent_attention", "embed": "embedding",
}  # fmt: skip
ORDER = [
    "scheduling", "embedding", "norms", "qkv_proj", "attention", "latent_attention", "o_proj",
    "gate_up_proj", "activation", "down_proj", "experts", "lm_head", "sampling",
]  # fmt: skip


@dataclass
class Clock:
    """Stamps (label, seconds) as the hooks fire."""

    device: torch.device
    stamps: list = field(default_factory=list)

    def stamp(self, label: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stamps.append((label, time.perf_counter()))


def component(before: str, after: str) -> str:
    """The component the span between two stamps belongs to."""
    if after == "step:start" or after == "model:start":
        return "scheduling"
    if before == "model:end":
        return "sampling"
    name, _, edge = after.partition(":")
    if edge == "end" and name in PRODUCTS:
        return PRODUCTS[name]
    if before == "qkv:end" and after == "o_proj:start":
        return "attention"
    if before == "gate_up:end":
        return "activation"
    return "norms"  # norms, residual adds, RoPE tables: the elementwise rest


def hook(model: torch.nn.Module, clock: Clock) -> list:
    """Stamp the boundaries of the model, its layers and their products."""
    handles = []

    def add(module, label):
        handles.append(module.register_forward_pre_hook(lambda *_: clock.stamp(label + ":start")))
        handles.append(module.register_forward_hook(lambda *_: clock.stamp(label + ":end")))

    add(model, "model")
    for name, module in model.named_modules():
        last = name.rpartition(".")[2]
        if last in PRODUCTS and "." not in name.partition("layers.")[2].partition(".")[2]:
            add(module, last)
    return handles


def spans(stamps: list) -> dict[str, float]:
    out: dict[str, float] = {}
    for (a, t0), (b, t1) in zip(stamps, stamps[1:], strict=False):
        c = component(a, b)
        out[c] = out.get(c, 0.0) + t1 - t0
    return out


# ------------------------------------------------------------------ shapes -> work


def work(shape: ModelShape, contexts: list[int], read: list[int], head_rows: int,
         weight_bytes: dict, act: int, kv: int) -> dict[str, tuple[float, float]]:  # fmt: skip
    """component -> (FLOPs, bytes) of a step: a new token for each of `contexts` (the keys
    it attends to); `read`: the keys each sequence reads a layer (its context); `head_rows`
    rows of logits; weight_bytes: component -> the bytes its weights are stored in; act,
    kv: bytes of an activation and of a cached element."""
    s, t, h = shape, len(contexts), shape.hidden
    q_out, kv_out = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
    layers = s.n_layers
    dense = layers - s.moe_layers  # the layers with a dense MLP
    mlp_width = s.intermediate

    def product(name, k, n, rows=t, times=layers):
        """(FLOPs, bytes) of a [rows, k] x [k, n] product in `times` layers."""
        return 2.0 * rows * k * n * times, weight_bytes.get(name, 0) + act * rows * (k + n) * times

    out = {
        "embedding": (0.0, act * t * h * 2),
        "qkv_proj": product("qkv_proj", h, q_out + 2 * kv_out),
        "o_proj": product("o_proj", q_out, h),
        "gate_up_proj": product("gate_up_proj", h, 2 * mlp_width, times=dense),
        "down_proj": product("down_proj", mlp_width, h, times=dense),
        "lm_head": product("lm_head", h, s.vocab, head_rows, times=1),
    }
    if s.is_moe:
        out["experts"] = experts_work(s, t, weight_bytes, act)
    attn_flops = sum(s.attention_flops_per_token(c) for c in contexts)
    keys_read = 0
    for i in range(layers):  # each sequence's keys once a layer
        keys_read += sum(min(c, s.sliding_window) if s.is_local(i) else c for c in read)
    kv_read = keys_read * 2 * kv_out * kv
    out["attention"] = (attn_flops, kv_read + act * t * (2 * q_out + 2 * kv_out) * layers)
    out["activation"] = (3.0 * t * mlp_width * dense, act * t * 3 * mlp_width * dense)
    norms = (4 if s.sandwich_norms else 2) * layers + 1
    out["norms"] = (4.0 * t * h * norms, act * t * h * 2 * norms)
    return out


def experts_work(s: ModelShape, t: int, weight_bytes: dict, act: int) -> tuple[float, float]:
    """(FLOPs, bytes) of the MoE layers' MLPs for t tokens: each token's router, its k
    routed experts and the shared ones (the planner's active parameters); the bytes are
    the shared weights and the routed experts a step touches on average (uniform routing,
    roofline.expected_experts), as stored."""
    from tokenworks.plan.roofline import expected_experts

    moe = [i for i in range(s.n_layers) if i >= s.first_dense_layers]
    active = sum(s.mlp_params(i, active=True) for i in moe)
    touched = min(1.0, expected_experts(s, t) / s.n_experts)
    moved = weight_bytes.get("experts", 0) * touched + weight_bytes.get("experts_shared", 0)
    return 2.0 * t * active, moved + act * t * 2 * s.hidden * len(moe)


def stored_bytes(model: torch.nn.Module) -> dict[str, int]:
    """component -> bytes of its weights as stored, over all layers; an MoE layer's
    routed experts under "experts", its router and shared experts under "experts_shared"."""
    out: dict[str, int] = {}

    def add(key, tensors):
        out[key] = out.get(key, 0) + sum(t.numel() * t.element_size() for t in tensors)

    for name, module in model.named_modules():
        last = name.rpartition(".")[2]
        if last == "moe":
            routed = [module.gate_up, module.down] if module.blocks is None else []
            routed += list(_tensors(module.blocks)) if module.blocks is not None else []
            ids = {x.data_ptr() for x in routed if x is not None}
            add("experts", [x for x in routed if x is not None])
            add("experts_shared", [x for x in _tensors(module) if x.data_ptr() not in ids])
        elif last in PRODUCTS and last not in ("embed", "mla"):
            add(PRODUCTS[last], _tensors(module))
    return out


def _tensors(module):
    """Its parameters and buffers (a GGUF product's blocks are buffers), each once."""
    seen = set()
    for t in list(module.parameters()) + list(module.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            yield t


# ------------------------------------------------------------------ the run


def run_step(loop: EngineLoop, clock: Clock) -> None:
    clock.stamp("step:start")
    loop.step()
    clock.stamp("step:end")


def profile_phase(loop: EngineLoop, phase: str, repeats: int, hw, make_seqs) -> dict:
    """Time `phase` (make_seqs() sets up the step to run), hooked once a repeat and
    unhooked once a repeat, in turns; the fastest of each is reported (the least
    disturbed by whatever else the machine runs)."""
    engine = loop.engine
    device = torch.device(engine.config.device)
    plain, hooked = [], []
    for _ in range(repeats):
        make_seqs()
        plain.append(timed_step(loop))  # synchronised on CUDA, as the stamps are
        contexts, read, head_rows = make_seqs()
        clock = Clock(device)
        handles = hook(engine.model, clock)
        try:
            run_step(loop, clock)
        finally:
            for h in handles:
                h.remove()
        hooked.append(spans(clock.stamps))
    middle = min(hooked, key=lambda s: sum(s.values()))
    act_dtype = engine.config.torch_dtype
    act = torch.tensor([], dtype=act_dtype).element_size()
    kv = engine.pool.k[0].element_size()
    shapes = work(engine.spec.shape, contexts, read, head_rows, stored_bytes(engine.model), act,
                  kv)  # fmt: skip
    # the ceiling: on a CPU its best probed matmul rate (GGUF blocks, int8 and float
    # products all count against it), on a GPU its rate in the model's dtype
    dtype = {1: "int8", 2: "fp16" if act_dtype == torch.float16 else "bf16", 4: "fp32"}[act]
    peak = max(hw.flops.values()) if hw.kind == "cpu" else hw.peak(dtype)
    rows = {}
    for c in ORDER:
        if c not in middle:
            continue
        flops, moved = shapes.get(c, (0.0, 0.0))
        sec = middle[c]
        floor = max(moved / hw.bandwidth, flops / peak)
        rows[c] = {
            "seconds": sec, "flops": flops, "bytes": moved,
            "gflops_per_s": flops / sec / 1e9 if sec else 0.0,
            "gb_per_s": moved / sec / 1e9 if sec else 0.0,
            "roofline_seconds": floor, "roofline_share": floor / sec if sec else 0.0,
        }  # fmt: skip
    return {
        "phase": phase, "tokens": len(contexts), "contexts": [min(contexts), max(contexts)],
        "components": rows, "hooked_seconds": sum(middle.values()),
        "step_seconds": min(plain),
    }  # fmt: skip


def profile(loop: EngineLoop, prompt_tokens: int, batch: int, repeats: int, hw) -> dict:
    """Both phases on an engine that runs the torch modules, with no prefix caching (each
    prompt pass computes the whole prompt)."""
    from tokenworks.engine.request import SamplingParams

    engine = loop.engine
    vocab = engine.spec.vocab_size
    prompt = [(7 * i + 3) % (vocab - 1) + 1 for i in range(prompt_tokens)]
    greedy = SamplingParams(max_tokens=1 << 20, temperature=0, ignore_eos=True)
    running = []

    def restart(n):
        for seq in running:
            loop.abort(seq.request_id)
        running.clear()
        running.extend(loop.add_request(prompt, greedy) for _ in range(n))

    def one_prompt():
        restart(1)
        return list(range(1, prompt_tokens + 1)), [prompt_tokens], 1

    def decode_batch():
        if len(running) != batch or running[0].n_cached < prompt_tokens:
            restart(batch)
            loop.run_while(lambda: any(seq.n_cached < prompt_tokens for seq in running))
        ctx = [seq.num_tokens for seq in running]
        return ctx, ctx, batch

    with torch.inference_mode():
        phases = [
            profile_phase(loop, "prefill", repeats, hw, one_prompt),
            profile_phase(loop, "decode", repeats, hw, decode_batch),
        ]
    restart(0)
    return {
        "model": engine.loaded.model_id, "config": dataclasses.asdict(engine.config),
        "hardware": hw.__dict__, "phases": phases,
    }  # fmt: skip


def ceiling(device: str, name: str | None):
    """The roofline's rates: a named device from the planner's table, else this CPU
    measured, or on CUDA the table's entry whose name the GPU's contains."""
    from tokenworks.plan.hardware import HARDWARE
    from tokenworks.plan.machines import get_hardware
    from tokenworks.plan.probe import probe

    if name is not None:
        return get_hardware(name)
    if device == "cpu":
        return probe(threads=torch.get_num_threads(), matmul_size=1024, repeats=2)
    gpu = torch.cuda.get_device_name(torch.device(device)).lower()
    found = [h for key, h in HARDWARE.items() if key.split("-")[0] in gpu]
    if not found:
        raise ValueError(f"no roofline figures for {gpu!r}: name one with --hardware")
    return found[0]


def run_profile(args) -> int:
    from tokenworks import LLM
    from tokenworks.config import engine_kwargs

    kw = engine_kwargs(args) | {"kernels": "torch", "enable_prefix_caching": False}
    kw["max_num_batched_tokens"] = max(kw["max_num_batched_tokens"], args.prompt_tokens)
    kw["max_num_seqs"] = max(kw["max_num_seqs"], args.batch)
    loop = LLM(args.model, **kw).loop
    hw = ceiling(loop.engine.config.device, args.hardware)
    result = profile(loop, args.prompt_tokens, args.batch, args.repeats, hw)
    print(json.dumps(result, indent=1, default=str) if args.json else table(result))
    if args.record:
        from tokenworks.bench.record import make_record, write_record

        record = make_record(
            kind="profile",
            engine=result["config"],
            model={"id": result["model"]},
            workload={
                "prompt_tokens": args.prompt_tokens,
                "batch": args.batch,
                "repeats": args.repeats,
            },  # fmt: skip
            results={
                "phases": {p["phase"]: p for p in result["phases"]},
                "hardware_probe": result["hardware"],
            },  # fmt: skip
        )
        print(f"record: {write_record(record, args.record)}", file=sys.stderr)
    return 0


def table(result: dict) -> str:
    out = []
    for p in result["phases"]:
        out.append(
            f"\n{p['phase']}: {p['tokens']} tokens, step {p['step_seconds'] * 1e3:.2f} ms "
            f"(hooked {p['hooked_seconds'] * 1e3:.2f} ms)"
        )
        out.append("| component | ms | share | GFLOP | MB | GFLOP/s | GB/s | roofline |")
        out.append("|---|---|---|---|---|---|---|---|")
        total = p["hooked_seconds"]
        for name, r in p["components"].items():
            out.append(
                f"| {name} | {r['seconds'] * 1e3:.2f} | {r['seconds'] / total:.0%} | "
                f"{r['flops'] / 1e9:.3f} | {r['bytes'] / 1e6:.1f} | {r['gflops_per_s']:.1f} | "
                f"{r['gb_per_s']:.1f} | {r['roofline_share']:.0%} |"
            )
    return "\n".join(out)
