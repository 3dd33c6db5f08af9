"""What a tokenworks server says of itself around a benchmark point: its API process's
seconds per request by phase and its prefix cache's hits, read from /metrics before and
after (nothing from a server that is not ours)."""

from __future__ import annotations

# the host tier's counters (serve/metrics.py): stored, copied back, pushed out by its budget
OFFLOAD_SERIES = (
    "tokenworks:kv_offload_blocks",
    "tokenworks:kv_restore_blocks",
    "tokenworks:kv_offload_dropped_blocks",
)


def server_counters(base_url: str, api_key: str | None) -> dict | None:
    """A tokenworks server's running counters that a point's figures are read from:
    {"phases": {phase: [seconds, requests]}} of tokenworks:api_process_seconds
    (serve/api_times.py), "prefix": [hit, queried] prompt tokens summed over its engines,
    "misses": {reason: requests} of tokenworks:prefix_cache_misses, and "offload": the
    host tier's blocks stored, copied back and dropped (OFFLOAD_SERIES). None from another
    engine's server, or an unreadable one."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    try:
        text = httpx.get(base_url.rstrip("/") + "/metrics", headers=headers, timeout=10).text
        families = list(text_string_to_metric_families(text))
    except (httpx.HTTPError, ValueError):
        return None
    phases: dict[str, list[float]] = {}
    prefix = [0.0, 0.0]
    misses: dict[str, float] = {}
    offload = {}
    for family in families:
        if family.name in OFFLOAD_SERIES:
            offload[family.name.split(":")[1]] = sum(
                s.value for s in family.samples if s.name.endswith("_total")
            )
        elif family.name == "tokenworks:prefix_cache_misses":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    reason = sample.labels.get("reason", "?")
                    misses[reason] = misses.get(reason, 0.0) + sample.value
        elif family.name == "tokenworks:prefix_cache_hits":
            prefix[0] += sum(s.value for s in family.samples)
        elif family.name == "tokenworks:prefix_cache_queries":
            prefix[1] += sum(s.value for s in family.samples)
        elif family.name == "tokenworks:api_process_seconds":
            for sample in family.samples:
                totals = phases.setdefault(sample.labels.get("phase", "?"), [0.0, 0.0])
                if sample.name.endswith("_sum"):
                    totals[0] += sample.value
                elif sample.name.endswith("_count"):
                    totals[1] += sample.value
    found = {"phases": phases, "prefix": prefix, "misses": misses, "offload": offload}
    return found if phases or prefix[1] else None


def api_process_means(before: dict | None, after: dict | None) -> dict | None:
    """Mean seconds per request in each phase of the API process between two
    server_counters readings, and their sum ("total")."""
    if not after:
        return None
    was = (before or {}).get("phases", {})
    means = {}
    for phase, (total, count) in after["phases"].items():
        was_total, was_count = was.get(phase, (0.0, 0.0))
        if count > was_count:
            means[phase] = (total - was_total) / (count - was_count)
    if means:
        means["total"] = sum(means.values())
    return means or None


def prefix_hit_rate(before: dict | None, after: dict | None) -> float | None:
    """The fraction of prompt tokens the server's prefix caches held between two readings."""
    if not after:
        return None
    hits, asked = after["prefix"]
    was_hits, was_asked = (before or {}).get("prefix", (0.0, 0.0))
    return (hits - was_hits) / (asked - was_asked) if asked > was_asked else None


def server_figures(before: dict | None, after: dict | None) -> dict:
    """What a point's record gains from two server_counters readings around it: the
    server's own seconds per request outside the engine, by phase, and its prefix-cache
    hit rate (nothing from a server that is not ours)."""
    out = {}
    api = api_process_means(before, after)
    if api:
        out["api_process_s"] = api
    hit_rate = prefix_hit_rate(before, after)
    if hit_rate is not None:
        out["prefix_hit_rate"] = hit_rate
    misses = prefix_misses(before, after)
    if misses:
        out["prefix_misses"] = misses
    if after and after.get("offload"):  # the host tier's blocks stored and copied back
        was = (before or {}).get("offload", {})
        out["kv_offload"] = {k: int(v - was.get(k, 0.0)) for k, v in after["offload"].items()}
    return out


def prefix_misses(before: dict | None, after: dict | None) -> dict[str, int]:
    """Requests finished between two readings, by why their prompts missed the prefix
    cache (prefix_cache.MISS_REASONS)."""
    was = (before or {}).get("misses", {})
    now = (after or {}).get("misses", {})
    return {r: int(n - was.get(r, 0.0)) for r, n in now.items() if n > was.get(r, 0.0)}
