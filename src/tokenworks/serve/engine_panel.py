"""GET /engine/state: what the web page's engine panel draws, as JSON, from the same
gauges and counts /metrics is made of (serve/metrics.py's observers), one entry per engine.

Counts are running totals since the engine started; the page turns them into rates by
differencing two polls (generation_tokens over `at` gives tokens a second).
"""

from __future__ import annotations

import time


def _speculation(m) -> dict | None:
    if m is None:
        return None
    return {
        "drafts": m.num_drafts,
        "draft_tokens": m.num_draft_tokens,
        "accepted_tokens": m.num_accepted_tokens,
        "acceptance_rate": m.acceptance_rate,
        "proposing": m.proposing,
        "held_back": m.held_back,
        "guessing_loses": bool(m.losing),
        "acceptance_estimate": m.mean_acceptance,
    }


def _engine(observer) -> dict:
    g = observer.last
    out = {"model": observer.model_name, "engine": observer.index, "seen_at": observer.last_at}
    if g is None:  # no step yet
        return out | {"running": 0, "waiting": 0, "kv": None, "prefix": None, "speculation": None}
    used = g.kv_blocks - g.kv_free_blocks
    out |= {
        "running": g.running,
        "waiting": g.waiting,
        "generation_tokens": g.generation_tokens,
        "kv": {
            "blocks": g.kv_blocks,
            "free": g.kv_free_blocks,
            "used": used,
            "usage": g.kv_usage,
            # where layers keep windows: each group's window (None: the whole context) and
            # the blocks its layers hold
            "groups": [
                {"window": w, "blocks": b}
                for w, b in zip(g.kv_group_windows, g.kv_group_blocks, strict=False)
            ],
        },
        "prefix": None
        if g.prefix_queried is None
        else {
            "queried_tokens": g.prefix_queried,
            "hit_tokens": g.prefix_hits,
            "misses": dict(observer.miss_counts),
        },
        "speculation": _speculation(g.speculation),
    }
    return out


def engine_state(state) -> dict:
    """Every engine the server's metrics have heard from, as the panel shows it."""
    return {"at": time.time(), "engines": [_engine(e) for e in state.metrics.engines()]}
