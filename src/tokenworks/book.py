"""The book's chapters, by number: each one's title and the commands that measure it
(as docs/book.md names them, `tokenworks ` and `python ` left off). The /lab page files
each evidence record under the chapters whose commands wrote it; tests/test_book.py holds
this table to the map.
"""

from __future__ import annotations

CHAPTERS: dict[int, tuple[str, tuple[str, ...]]] = {
    1: ("What Is Inference?", ("bench latency", "labs/request_anatomy.py")),
    2: ("From Training to Execution", ("bench load", "labs/cold_start.py")),
    3: ("Tokens, Embeddings and Probability", ("labs/tokens_to_choice.py",)),
    4: ("The Transformer as a Computation", ("labs/transformer_anatomy.py", "profile")),
    5: ("Autoregressive Generation", ("labs/prefill_vs_decode.py",)),
    6: ("Building Our First Inference Engine", ("bench latency",)),
    7: (
        "Matrix Multiplication and GPU Execution",
        ("benchmarks/gpu_speed.py", "benchmarks/gpu_check.sh"),
    ),
    8: (
        "Attention and Its Computational Cost",
        ("labs/tiled_attention.py", "labs/memory_traffic.py"),
    ),
    9: ("Prefill and Decode", ("labs/prefill_vs_decode.py", "labs/static_vs_continuous.py")),
    10: ("Key-Value Caching", ("labs/kv_cache_savings.py",)),
    11: (
        "Memory Bandwidth and Compute Bottlenecks",
        ("labs/roofline_ceilings.py", "labs/plan_vs_measured.py"),
    ),
    12: (
        "Quantization and Numerical Precision",
        ("bench quant", "labs/weight_formats.py", "labs/kv_cache_dtype.py"),
    ),
    13: (
        "FlashAttention and Optimized Kernels",
        ("labs/tiled_attention.py", "bench tiled-attention"),
    ),
    14: ("PagedAttention", ("labs/paging.py",)),
    15: ("Continuous Batching", ("labs/static_vs_continuous.py", "labs/prefill_fairness.py")),
    16: (
        "Prefix Caching",
        ("labs/prefix_cache_size.py", "labs/tenant_prefix_timing.py", "labs/kv_offload.py"),
    ),
    17: ("Speculative Decoding", ("labs/speculation.py", "bench spec")),
    18: ("Compilation and Execution Graphs", ("bench compiled",)),
    19: ("Mixture-of-Experts Inference", ("bench moe",)),
    20: ("Expert Routing and Load Balancing", ()),
    21: ("Multi-Head and Multi-Latent Attention", ("bench attention", "labs/kv_heads.py")),
    22: ("Sliding-Window Attention", ("labs/sliding_window.py", "bench long-context")),
    23: ("Long-Context Inference", ("bench long-context",)),
    24: ("Model Architecture Versus Runtime Architecture", ("labs/one_change.py",)),
    25: ("From Inference Loop to API", ("labs/api_boundary.py", "bench serve")),
    26: (
        "Request Scheduling and Admission Control",
        ("labs/admission_policies.py", "labs/queueing_overload.py"),
    ),
    27: (
        "Concurrent Requests and Streaming",
        ("labs/many_streams.py", "bench serve", "bench page"),
    ),
    28: ("Distributed Inference", ("bench parallel",)),
    29: ("Disaggregation", ("bench disaggregation",)),
    30: ("Reliability", ("bench soak",)),
    31: ("Protocols", ("bench serve",)),
    32: ("API-level optimization", ("labs/tenant_prefix_timing.py",)),
    33: ("Reasoning", ("labs/thinking_budget.py",)),
    34: ("Tool calling", ("labs/tool_calls.py",)),
    35: ("Structured outputs", ("bench structured",)),
    36: ("Latency and throughput", ("bench serve", "bench throughput")),
    37: ("Cost", ("plan cost",)),
    38: ("GPU utilization", ("benchmarks/gpu_check.sh", "benchmarks/gpu_speed.py")),
    39: ("Correctness", ("bench invariance", "bench lmeval", "bench world")),
    40: ("Benchmarks", ("bench peers", "benchmarks/serve_ab.py")),
    41: ("Runtime design", ("labs/step_anatomy.py",)),
    42: ("Scheduling and caching", ("labs/kv_offload.py",)),
    43: ("Multiple backends", ("bench backends",)),
    44: ("Benchmarking", ("bench peers", "benchmarks/gpu_speed.py")),
    45: ("Lessons", ("labs/lessons.py",)),
}


def chapters_of(command: str) -> list[int]:
    """The chapters a record's command line measures (none where no chapter names it)."""
    words = command.split()
    found = []
    for number, (_, signatures) in CHAPTERS.items():
        for sig in signatures:
            n = len(sig.split())
            said = (" ".join(words[i : i + n]) for i in range(len(words)))
            if any(w == sig or w.endswith("/" + sig) for w in said):
                found.append(number)
                break
    return found
