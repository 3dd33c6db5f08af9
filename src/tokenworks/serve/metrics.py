"""Prometheus metrics for /metrics, named the way vLLM names its own (`vllm:` -> `tokenworks:`),
so dashboards and the benchmark harness built for vLLM read them unchanged.

ServerMetrics is the AsyncEngine's observer: it hears every step (gauges, token and cache
counters) and every finished request (latency histograms, finish reasons), in the engine
thread; prometheus_client is thread-safe. Each app has its own registry.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Bucket edges in seconds (vLLM's, trimmed to what a CPU sees).
_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
_PER_TOKEN = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        labels = ["model_name"]
        self._labels = {"model_name": model_name}

        def hist(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(**self._labels)

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=r).labels(**self._labels)

        def counter(name, doc):
            return Counter(name, doc, labels, registry=r).labels(**self._labels)

        self.ttft = hist(
            "tokenworks:time_to_first_token_seconds", "Arrival to first token.", _LATENCY
        )
        self.itl = hist(
            "tokenworks:inter_token_latency_seconds", "Time between streamed tokens.", _PER_TOKEN
        )
        self.tpot = hist(
            "tokenworks:request_time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            _PER_TOKEN,
        )
        self.e2e = hist(
            "tokenworks:e2e_request_latency_seconds", "Arrival to last token.", _LATENCY
        )
        self.queue = hist(
            "tokenworks:request_queue_time_seconds", "Arrival to first scheduled.", _LATENCY
        )
        self.running = gauge("tokenworks:num_requests_running", "Sequences in the running set.")
        self.waiting = gauge("tokenworks:num_requests_waiting", "Sequences waiting to run.")
        self.kv_usage = gauge(
            "tokenworks:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full)."
        )
        self.prompt_tokens = counter(
            "tokenworks:prompt_tokens", "Prompt tokens of finished requests."
        )
        self.generation_tokens = counter(
            "tokenworks:generation_tokens", "Generated tokens of finished requests."
        )
        self.prefix_queries = counter(
            "tokenworks:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = counter(
            "tokenworks:prefix_cache_hits", "Prompt tokens found in the prefix cache."
        )
        self.preemptions = counter("tokenworks:num_preemptions", "Sequences preempted.")
        # speculative decoding (vLLM's spec_decode names), with the time each side took
        self._spec = {
            "num_drafts": counter(
                "tokenworks:spec_decode_num_drafts", "Proposals verified (one per sequence-step)."
            ),
            "num_draft_tokens": counter(
                "tokenworks:spec_decode_num_draft_tokens", "Proposed tokens verified."
            ),
            "num_accepted_tokens": counter(
                "tokenworks:spec_decode_num_accepted_tokens", "Proposed tokens accepted."
            ),
            "num_emitted_tokens": counter(
                "tokenworks:spec_decode_num_emitted_tokens",
                "Tokens verify steps produced (accepted plus the target's own).",
            ),
            "draft_seconds": counter(
                "tokenworks:spec_decode_draft_seconds", "Seconds spent proposing."
            ),
            "verify_seconds": counter(
                "tokenworks:spec_decode_verify_seconds",
                "Seconds of steps that verified proposals, less their proposing.",
            ),
        }
        self._per_pos = Counter(
            "tokenworks:spec_decode_num_accepted_tokens_per_pos",
            "Accepted proposals by their position in the proposal.",
            ["model_name", "position"],
            registry=r,
        )
        self._spec_seen: dict = {}
        self._finished = Counter(
            "tokenworks:request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self._queried = self._hits = 0

    # ------------------------------------------------------------------ observer hooks

    def on_state(self, gauges) -> None:
        """The engine as it is now (EngineGauges: after a step, or after requests left)."""
        self.running.set(gauges.running)
        self.waiting.set(gauges.waiting)
        self.kv_usage.set(gauges.kv_usage)

    def on_step(self, preemptions: int, gauges) -> None:
        self.on_state(gauges)
        self.preemptions.inc(preemptions)
        if gauges.prefix_queried is not None:  # the cache's own running counts, as deltas
            self.prefix_queries.inc(max(0, gauges.prefix_queried - self._queried))
            self.prefix_hits.inc(max(0, gauges.prefix_hits - self._hits))
            self._queried, self._hits = gauges.prefix_queried, gauges.prefix_hits
        if gauges.speculation is not None:
            self._count_speculation(gauges.speculation)

    def _count_speculation(self, m) -> None:
        """The speculator's running totals, as deltas since the last step."""
        for name, c in self._spec.items():
            value = getattr(m, name)
            c.inc(max(0, value - self._spec_seen.get(name, 0)))
            self._spec_seen[name] = value
        for pos, value in enumerate(m.accepted_per_pos):
            key = ("pos", pos)
            delta = value - self._spec_seen.get(key, 0)
            if delta > 0:
                self._per_pos.labels(position=str(pos), **self._labels).inc(delta)
            self._spec_seen[key] = value

    def on_inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def on_request_finished(self, m) -> None:
        self.prompt_tokens.inc(m.prompt_tokens)
        self.generation_tokens.inc(m.generation_tokens)
        self.e2e.observe(m.e2e)
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        if m.queue_time is not None:
            self.queue.observe(m.queue_time)
        if m.tpot is not None:
            self.tpot.observe(m.tpot)
        for reason in m.finish_reasons:
            self._finished.labels(finished_reason=reason, **self._labels).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
