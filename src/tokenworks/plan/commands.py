"""`tokenworks plan ...`: the planning toolkit on the command line, as tables or --json.

One short command per planner (models, hardware, kv, fit, roofline, quant, queue, spec,
cost, batching, paging, traffic, parallel), each a few lines of reading its options
(plan/configs.py) and a table, and the registry that names them.
"""

from __future__ import annotations

import json

from tokenworks.options import add_arguments, from_args
from tokenworks.plan import configs
from tokenworks.units import GiB, dtype_name, fmt_bytes, fmt_rate, fmt_seconds


def table(rows: list[dict], columns: list[str] | None = None) -> str:
    """A plain aligned text table (the first row's keys, or `columns`)."""
    if not rows:
        return "(nothing)"
    cols = columns or list(rows[0])
    cells = [[str(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]

    def line(vals):
        return "  ".join(v.ljust(w) for v, w in zip(vals, widths, strict=True)).rstrip()

    return "\n".join([line(cols), line(["-" * w for w in widths]), *map(line, cells)])


def _emit(args, rows: list[dict] | dict, text: str) -> None:
    print(json.dumps(rows, indent=2) if args.json else text)


def _compute_dtype(args, scheme) -> str:
    if args.compute_dtype:
        return args.compute_dtype
    return "fp8" if scheme.name == "fp8" else "bf16"


# ------------------------------------------------------------------ commands


def cmd_models(args) -> int:
    from tokenworks.plan.kv import kv_bytes_per_token
    from tokenworks.plan.models import MODELS

    rows = []
    for m in MODELS.values():
        rows.append(
            {
                "model": m.name,
                "params": f"{m.params() / 1e9:.3g}B",
                "active": f"{m.params(True) / 1e9:.3g}B",
                "layers": m.n_layers,
                "attention": m.attention
                + (f"+window {m.sliding_window}" if m.sliding_window else ""),
                "kv/token bf16": fmt_bytes(kv_bytes_per_token(m)),
                "source": m.source,
            }
        )
    _emit(args, rows, table(rows))
    return 0


def cmd_hardware(args) -> int:
    from tokenworks.plan.hardware import HARDWARE
    from tokenworks.plan.probe import probe

    hws = list(HARDWARE.values()) + ([probe(args.threads)] if args.probe else [])
    rows = [
        {
            "hardware": h.name,
            "memory": fmt_bytes(h.memory_bytes),
            "bandwidth": fmt_rate(h.bandwidth),
            "bf16 peak": fmt_rate(h.peak("bf16"), "FLOP/s"),
            "ridge FLOP/B": f"{h.ridge('bf16'):.0f}",
            "source": h.source,
        }
        for h in hws
    ]
    _emit(args, rows, table(rows))
    return 0


def cmd_kv(args) -> int:
    from tokenworks.plan.kv import kv_bytes, kv_bytes_per_token
    from tokenworks.plan.memory import lora_bytes
    from tokenworks.plan.models import get_model

    m = get_model(args.model)
    rows = []
    for c in args.context:
        row = {
            "context": c,
            "kv per sequence": fmt_bytes(kv_bytes(m, c, args.kv_dtype)),
            "bytes": int(kv_bytes(m, c, args.kv_dtype)),
        }
        if args.block_size:  # what a paged pool holds: whole blocks, windows freeing
            paged = kv_bytes(m, c, args.kv_dtype, block_size=args.block_size)
            row |= {f"paged ({args.block_size}-token blocks)": fmt_bytes(paged),
                    "paged bytes": int(paged)}  # fmt: skip
        rows.append(row)
    if m.attention == "mla":
        cached = f"a {m.kv_lora_rank} latent + {m.qk_rope_head_dim} RoPE key"
    else:
        cached = f"{m.n_kv_heads} KV heads x {m.head_dim}"
    head = (
        f"{m.name}: {m.attention.upper()}, {m.n_layers} layers, {cached}, "
        f"{dtype_name(args.kv_dtype)} cache: "
        f"{fmt_bytes(kv_bytes_per_token(m, args.kv_dtype))} per token"
        + (f" (before windows: local layers keep {m.sliding_window})" if m.sliding_window else "")
    )
    out = {"model": m.name, "per_token_bytes": kv_bytes_per_token(m, args.kv_dtype),
           "rows": rows}  # fmt: skip
    if args.max_lora_rank:  # what one adapter costs beside the cache
        out["lora_adapter_bytes"] = adapter = lora_bytes(m, args.max_lora_rank)
        head += (f"; a rank-{args.max_lora_rank} LoRA adapter on every product: "
                 f"{fmt_bytes(adapter)} (bf16)")  # fmt: skip
    _emit(args, out, head + "\n" + table(rows))
    return 0


def cmd_fit(args) -> int:
    from tokenworks.plan.machines import get_hardware
    from tokenworks.plan.memory import fit
    from tokenworks.plan.models import get_model
    from tokenworks.plan.quant import parse_scheme

    f = fit(
        get_model(args.model),
        get_hardware(args.gpu),
        tp=args.tp,
        pp=args.pp,
        context=args.context,
        batch=args.batch,
        scheme=parse_scheme(args.dtype),
        kv_dtype=args.kv_dtype,
        utilization=args.utilization,
        overhead=args.overhead_gib * GiB,
        adapters=args.max_loras,
        adapter_rank=args.max_lora_rank,
    )
    rows = [
        {"per device": "memory", "value": fmt_bytes(f.device_memory)},
        {
            "per device": f"usable (x{args.utilization} - {args.overhead_gib} GiB overhead)",
            "value": fmt_bytes(f.usable),
        },  # fmt: skip
        {
            "per device": f"weights ({f.weight_format}, tp {f.tp}, pp {f.pp})",
            "value": fmt_bytes(f.weights_per_device),
        },  # fmt: skip
        *(
            [
                {
                    "per device": f"LoRA adapters ({args.max_loras} of rank {args.max_lora_rank})",
                    "value": fmt_bytes(f.adapters_per_device),
                }
            ]
            if args.max_loras
            else []
        ),  # fmt: skip
        {"per device": "left for the KV cache", "value": fmt_bytes(f.kv_budget_per_device)},
        {"per device": "KV per token", "value": fmt_bytes(f.kv_per_token_per_device)},
        {
            "per device": f"KV per sequence at {f.context} tokens",
            "value": fmt_bytes(f.kv_per_sequence_per_device),
        },  # fmt: skip
        {"per device": "sequences that fit", "value": f.max_sequences},
    ]
    text = f"{f.model} on {f.devices} x {f.hardware}: {f.verdict}\n" + table(rows)
    _emit(args, f.to_dict(), text)
    return 0 if f.fits else 1


def cmd_roofline(args) -> int:
    from tokenworks.plan.machines import get_hardware
    from tokenworks.plan.models import get_model
    from tokenworks.plan.quant import parse_scheme
    from tokenworks.plan.roofline import decode, prefill, ridge_batch

    m, hw, scheme = get_model(args.model), get_hardware(args.gpu), parse_scheme(args.dtype)
    cd = _compute_dtype(args, scheme)
    ceilings = [
        decode(m, hw, scheme, batch=b, context=args.context, kv_dtype=args.kv_dtype,
               compute_dtype=cd)
        for b in args.batch
    ]  # fmt: skip
    ceilings += [
        prefill(m, hw, scheme, prompt=p, kv_dtype=args.kv_dtype, compute_dtype=cd)
        for p in args.prompt
    ]
    rb = ridge_batch(m, hw, scheme, context=args.context, kv_dtype=args.kv_dtype,
                     compute_dtype=cd)  # fmt: skip
    rows = [
        {
            "phase": c.phase,
            "batch": c.batch,
            "tokens": c.tokens,
            "context": c.context,
            "moved": fmt_bytes(c.weight_bytes + c.kv_bytes),
            "FLOP": f"{c.flops:.3g}",
            "FLOP/B": f"{c.intensity:.1f}",
            "step": fmt_seconds(c.step_time_s),
            "bound": c.bound,
            "tok/s total": f"{c.tokens_per_s:,.0f}",
            "tok/s per seq": f"{c.tokens_per_s_per_seq:,.1f}",
        }
        for c in ceilings
    ]
    ridge = (
        f"decode turns compute-bound at batch {rb}"
        if rb
        else "decode stays memory-bound at every batch (KV reads grow with it)"
    )
    head = (
        f"{m.name} ({scheme.name} weights, {cd} math, {dtype_name(args.kv_dtype)} KV) on "
        f"{hw.name}: {fmt_rate(hw.bandwidth)}, {fmt_rate(hw.peak(cd), 'FLOP/s')}, ridge "
        f"{hw.ridge(cd):.0f} FLOP/B; at context {args.context} {ridge}"
    )
    _emit(args, {"ridge_batch": rb, "ceilings": [c.to_dict() for c in ceilings]},
          head + "\n" + table(rows))  # fmt: skip
    return 0


def cmd_quant(args) -> int:
    from tokenworks.plan.models import get_model
    from tokenworks.plan.quant import parse_scheme, weight_bytes

    m = get_model(args.model)
    rows = []
    for spec in args.formats:
        s = parse_scheme(spec)
        rows.append(
            {
                "format": s.name,
                "bits/weight": f"{s.bits_per_weight:.4g}",
                "weights": fmt_bytes(weight_bytes(m, s)),
                "bytes": int(weight_bytes(m, s)),
            }
        )
    _emit(args, rows, f"{m.name}: {m.params():,} parameters\n" + table(rows))
    return 0


def cmd_queue(args) -> int:
    from tokenworks.plan.queueing import mg1, mm1, simulate

    out = {"mg1": mg1(args.rate, args.service_mean, args.service_cv2)}
    if args.service_cv2 == 1:
        out["mm1"] = mm1(args.rate, 1 / args.service_mean)
    if args.simulate:
        mean, cv2 = args.service_mean, args.service_cv2
        if cv2 == 0:
            service = lambda r: mean  # noqa: E731
        else:  # gamma with the given mean and squared CV
            shape = 1 / cv2
            service = lambda r: r.gammavariate(shape, mean / shape)  # noqa: E731
        out["simulated"] = simulate(args.rate, service, n=args.requests, seed=args.seed)
    rows = [
        {"model": k, "utilization": f"{v.get('utilization', out['mg1']['utilization']):.3f}",
         "mean wait": fmt_seconds(v["mean_wait_s"]),
         "mean time in system": fmt_seconds(v["mean_time_in_system_s"])}
        for k, v in out.items()
    ]  # fmt: skip
    _emit(args, out, table(rows))
    return 0


def cmd_spec(args) -> int:
    from tokenworks.plan.speculative import best_k, expected_tokens, monte_carlo, speedup

    rows = []
    for k in args.k:
        row = {
            "k": k,
            "tokens/pass": f"{expected_tokens(args.alpha, k):.3f}",
            "speed-up": f"{speedup(args.alpha, k, args.draft_cost):.3f}",
        }
        if args.monte_carlo:
            row["monte carlo tokens/pass"] = f"{monte_carlo(args.alpha, k, seed=args.seed):.3f}"
        rows.append(row)
    best = best_k(args.alpha, args.draft_cost)
    head = (
        f"acceptance {args.alpha}, draft pass = {args.draft_cost} target passes; best k = "
        f"{best} ({speedup(args.alpha, best, args.draft_cost):.3f}x)"
    )
    _emit(args, {"best_k": best, "rows": rows}, head + "\n" + table(rows))
    return 0


def cmd_cost(args) -> int:
    from tokenworks.plan.cost import cost_per_million

    c = cost_per_million(args.price_per_hour, args.tokens_per_s, args.devices)
    _emit(
        args,
        {"cost_per_million_tokens": c},
        f"{args.devices} device(s) at {args.price_per_hour}/h, {args.tokens_per_s:,.0f} tok/s: "
        f"{c:.4g} per million tokens",
    )
    return 0


def cmd_batching(args) -> int:
    from tokenworks.plan.batching import compare_batching, expected_static_utilization, lengths

    outs = lengths(args.requests, args.min_out, args.max_out, args.seed)
    r = compare_batching(outs, args.batch)
    r["static_utilization_closed_form"] = expected_static_utilization(
        args.min_out, args.max_out, args.batch
    )
    rows = [{"figure": k, "value": f"{v:.4g}" if isinstance(v, float) else v} for k, v in r.items()]
    _emit(args, r, table(rows))
    return 0


def cmd_paging(args) -> int:
    from tokenworks.plan.batching import compare_paging, lengths
    from tokenworks.plan.kv import kv_bytes_per_token
    from tokenworks.plan.models import get_model

    per_token = kv_bytes_per_token(get_model(args.model), args.kv_dtype)
    seqs = lengths(args.requests, args.min_len, args.max_len, args.seed)
    r = compare_paging(seqs, args.reserve or args.max_len, args.block_size, per_token)
    rows = [
        {"figure": k, "value": fmt_bytes(v) if k.endswith("bytes") else
         (f"{v:.4g}" if isinstance(v, float) else v)}
        for k, v in r.items()
    ]  # fmt: skip
    _emit(args, r, table(rows))
    return 0


def cmd_traffic(args) -> int:
    from tokenworks.plan import traffic as tr

    warp = [
        {"stride": st, "offset B": off, "sectors": tr.warp_sectors(st, off, args.elem),
         "efficiency": f"{tr.coalescing_efficiency(st, off, args.elem):.0%}"}
        for st in args.strides for off in args.offsets
    ]  # fmt: skip
    m, n, k = args.matmul
    products = [{"tile": "none" if t is None else f"{t[0]}x{t[1]}",
                 "bytes": fmt_bytes(tr.matmul_bytes(m, n, k, args.elem, t))}
                for t in [None] + [(x, x) for x in args.tiles]]  # fmt: skip
    attn = []
    for length in args.length:
        shape = tr.AttentionShape(length, length, args.head_dim, args.heads, args.kv_heads,
                                  args.elem)  # fmt: skip
        naive = tr.naive_attention_bytes(shape)
        row = {"length": length, "naive": fmt_bytes(naive)}
        for t in args.tiles:
            tiled = tr.tiled_attention_bytes(shape, t, t)
            row[f"tiled {t}"] = f"{fmt_bytes(tiled)} ({naive / tiled:.0f}x less)"
        attn.append(row)
    text = "\n\n".join([
        f"a warp of 32 reads of {args.elem}-byte elements (32-byte sectors):\n" + table(warp),
        f"C[{m}x{n}] = A[{m}x{k}] B[{k}x{n}], {args.elem}-byte elements:\n" + table(products),
        f"causal attention, {args.heads} heads on {args.kv_heads} KV heads of "
        f"{args.head_dim}, float32 scores:\n" + table(attn),
    ])  # fmt: skip
    _emit(args, {"warp": warp, "matmul": products, "attention": attn}, text)
    return 0


# ------------------------------------------------------------------ the parser


def cmd_parallel(args) -> int:
    from tokenworks.plan import parallel
    from tokenworks.plan.machines import get_hardware
    from tokenworks.plan.models import get_model
    from tokenworks.plan.quant import parse_scheme

    m, hw, scheme = get_model(args.model), get_hardware(args.gpu), parse_scheme(args.dtype)
    if args.link == "measured":
        from tokenworks.plan.probe import probe_link

        sizes, seconds = probe_link()
        link = parallel.fit_link(sizes, seconds)
    else:
        link = parallel.get_link(args.link)
    devices = args.devices or ("shared" if hw.kind == "cpu" else "separate")
    splits = [
        parallel.split_step(
            m,
            hw,
            scheme,
            link,
            tp,
            pp,
            phase,
            batch,
            args.context,
            args.prompt,
            act_bytes=args.act_bytes,
            devices=devices,
            compute_dtype=_compute_dtype(args, scheme),
        )  # fmt: skip
        for phase, batches in (("decode", args.batch), ("prefill", [1]))
        for batch in batches
        for tp in args.tp
        for pp in args.pp
    ]
    rows = [
        {
            "split": s.strategy, "phase": s.phase, "tokens": s.tokens,
            "compute": fmt_seconds(s.compute_s), "comm": fmt_seconds(s.comm_s),
            "step": fmt_seconds(s.step_s), "speed-up": f"{s.speedup:.2f}x",
            "bytes/token": fmt_bytes(s.bytes_per_token), "messages": s.messages,
            "pays": "-" if s.tp * s.pp == 1 else "yes" if s.pays else "no",
        }
        for s in splits
    ]  # fmt: skip
    head = (
        f"{m.name} on {hw.name} ({devices} devices), link {link.name}: "
        f"{fmt_rate(link.bandwidth)}, {fmt_seconds(link.latency)} a message"
    )
    out = {"link": link.__dict__, "devices": devices, "splits": [s.to_dict() for s in splits]}
    _emit(args, out, head + "\n" + table(rows))
    return 0


# name -> (its options, the command, what it says)
COMMANDS = {
    "models": (configs.PlanConfig, cmd_models,
               "the model catalogue: parameters, attention, KV per token"),
    "hardware": (configs.HardwarePlan, cmd_hardware,
                 "the hardware catalogue (with --probe: this CPU)"),
    "kv": (configs.KvPlan, cmd_kv, "KV cache bytes per token and per sequence"),
    "fit": (configs.FitPlan, cmd_fit, "does it fit: weights + KV per device, sequences that fit"),
    "roofline": (configs.RooflinePlan, cmd_roofline, "decode and prefill ceilings, and the bound"),
    "quant": (configs.QuantPlan, cmd_quant, "bits per weight and weight bytes by format"),
    "queue": (configs.QueuePlan, cmd_queue, "M/M/1 and M/G/1 waits (and a simulation)"),
    "spec": (configs.SpecPlan, cmd_spec, "speculative decoding: tokens per pass, speed-up"),
    "cost": (configs.CostPlan, cmd_cost, "cost per million tokens"),
    "batching": (configs.BatchingPlan, cmd_batching,
                 "static versus continuous batching, simulated"),
    "traffic": (configs.TrafficPlan, cmd_traffic,
                "memory traffic: warp coalescing, tiled products, naive against tiled attention"),
    "parallel": (configs.ParallelPlan, cmd_parallel,
                 "tensor and pipeline parallelism: what each sends, and whether it pays"),
    "paging": (configs.PagingPlan, cmd_paging, "contiguous versus paged KV allocation"),
}  # fmt: skip


def _run(config: type, command):
    return lambda args: command(from_args(config, args))


def add_plan_parser(sub) -> None:
    plan = sub.add_parser("plan", help="predictions: fit, roofline, KV, queues, cost...")
    psub = plan.add_subparsers(dest="plan_command", required=True)
    for name, (config, command, help) in COMMANDS.items():
        p = psub.add_parser(name, help=help)
        add_arguments(p, config)
        p.set_defaults(fn=_run(config, command))
