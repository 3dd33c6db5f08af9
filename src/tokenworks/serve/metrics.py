"""Prometheus metrics for /metrics, named the way vLLM names its own, under the prefix
`tokenworks:` (`--metrics-prefix vllm` gives vLLM's own names, so dashboards and the
benchmark harness built for vLLM read them unchanged).

ServerMetrics is the engine front's observer: it hears every step (gauges, token and cache
counters) and every finished request (latency histograms, finish reasons), in the engine
thread or a core process's reader thread; prometheus_client is thread-safe. Each app has
its own registry, and every series is labelled by engine (replica).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Bucket edges in seconds (vLLM's, trimmed to what a CPU sees).
_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
_API = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)
_PER_TOKEN = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5)


class ServerMetrics:
    """The server's metric families, one series per engine (label `engine`: "0", or each
    replica's index behind a router, as vLLM labels its data-parallel engines). Its hooks
    are engine 0's; for_engine(i) is the observer of replica i."""

    def __init__(self, model_name: str, prefix: str = "tokenworks"):
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name", "engine"]

        def hist(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=r)

        def counter(name, doc, extra=()):
            return Counter(name, doc, [*labels, *extra], registry=r)

        self.families = {
            "ttft": hist(
                f"{prefix}:time_to_first_token_seconds", "Arrival to first token.", _LATENCY
            ),
            "itl": hist(
                f"{prefix}:inter_token_latency_seconds",
                "Time between streamed tokens.",
                _PER_TOKEN,
            ),
            "tpot": hist(
                f"{prefix}:request_time_per_output_token_seconds",
                "Mean time per output token after the first, per request.",
                _PER_TOKEN,
            ),
            "e2e": hist(
                f"{prefix}:e2e_request_latency_seconds", "Arrival to last token.", _LATENCY
            ),
            "queue": hist(
                f"{prefix}:request_queue_time_seconds", "Arrival to first scheduled.", _LATENCY
            ),
            "running": gauge(f"{prefix}:num_requests_running", "Sequences in the running set."),
            "waiting": gauge(f"{prefix}:num_requests_waiting", "Sequences waiting to run."),
            "kv_usage": gauge(
                f"{prefix}:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full)."
            ),
            "prompt_tokens": counter(
                f"{prefix}:prompt_tokens", "Prompt tokens of finished requests."
            ),
            "generation_tokens": counter(
                f"{prefix}:generation_tokens", "Generated tokens of finished requests."
            ),
            "prefix_queries": counter(
                f"{prefix}:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
            ),
            "prefix_hits": counter(
                f"{prefix}:prefix_cache_hits", "Prompt tokens found in the prefix cache."
            ),
            "preemptions": counter(f"{prefix}:num_preemptions", "Sequences preempted."),
            "offloaded": counter(
                f"{prefix}:kv_offload_blocks",
                "Cached KV blocks evicted from the pool into the host tier (--kv-offload-gib).",
            ),
            "restored": counter(
                f"{prefix}:kv_restore_blocks",
                "KV blocks copied back from the host tier instead of computed again.",
            ),
            "offload_bytes": gauge(f"{prefix}:kv_offload_bytes", "Bytes the host tier holds."),
            "offload_dropped": counter(
                f"{prefix}:kv_offload_dropped_blocks",
                "Blocks the host tier's budget pushed out, oldest first (gone for good).",
            ),
            # the gateway's adapter gauge (vLLM's): one series, its labels the adapters of
            # the requests running and waiting, its value when they were last seen
            "loras": Gauge(
                f"{prefix}:lora_requests_info",
                "Running stats on LoRA requests.",
                ["max_lora", "running_lora_adapters", "waiting_lora_adapters", *labels],
                registry=r,
            ),
            "misses": counter(
                f"{prefix}:prefix_cache_misses",
                "Finished requests by why the first prompt block the prefix cache did not "
                "serve missed (never_cached, evicted, salt, adapter, window, not_full).",
                ("reason",),
            ),
            # speculative decoding (vLLM's spec_decode names), with the time each side took
            "num_drafts": counter(
                f"{prefix}:spec_decode_num_drafts", "Proposals verified (one per sequence-step)."
            ),
            "num_draft_tokens": counter(
                f"{prefix}:spec_decode_num_draft_tokens", "Proposed tokens verified."
            ),
            "num_accepted_tokens": counter(
                f"{prefix}:spec_decode_num_accepted_tokens", "Proposed tokens accepted."
            ),
            "num_emitted_tokens": counter(
                f"{prefix}:spec_decode_num_emitted_tokens",
                "Tokens verify steps produced (accepted plus the target's own).",
            ),
            "draft_seconds": counter(
                f"{prefix}:spec_decode_draft_seconds", "Seconds spent proposing."
            ),
            "verify_seconds": counter(
                f"{prefix}:spec_decode_verify_seconds",
                "Seconds of steps that verified proposals, less their proposing.",
            ),
            "spec_proposing": gauge(
                f"{prefix}:spec_decode_sequences_proposing",
                "Decoding sequences that proposed guesses at the last step.",
            ),
            "spec_held_back": gauge(
                f"{prefix}:spec_decode_sequences_held_back",
                "Decoding sequences the adaptive controller held back at the last step "
                "(their guesses did not pay, or guessing loses at this batch size).",
            ),
            "spec_losing": gauge(
                f"{prefix}:spec_decode_guessing_loses",
                "1 where steps with guesses have been slower than without at this batch size.",
            ),
            "spec_acceptance": gauge(
                f"{prefix}:spec_decode_acceptance_estimate",
                "The decoding sequences' mean estimate of a guess's chance to be accepted.",
            ),
            "per_pos": counter(
                f"{prefix}:spec_decode_num_accepted_tokens_per_pos",
                "Accepted proposals by their position in the proposal.",
                ["position"],
            ),
            "finished": counter(
                f"{prefix}:request_success",
                "Finished requests by finish reason.",
                ["finished_reason"],
            ),
        }
        # the API process's own work per request, by phase (serve/api_times.py)
        self.api_seconds = Histogram(
            f"{prefix}:api_process_seconds",
            "Seconds a request spent in the API process outside the engine, by phase.",
            ["model_name", "phase"],
            buckets=_API,
            registry=r,
        )
        self._engines: dict[tuple[str, int], EngineMetrics] = {}
        self._first = self.for_engine(0)

    def for_engine(self, index: int, model_name: str | None = None) -> EngineMetrics:
        """The observer whose series carry engine=index (and model_name: another
        backend's model, where the server serves several)."""
        key = (model_name or self.model_name, index)
        if key not in self._engines:
            self._engines[key] = EngineMetrics(self, index, key[0])
        return self._engines[key]

    def engines(self) -> list[EngineMetrics]:
        return list(self._engines.values())

    # engine 0's hooks: a server with one engine hands this object to it as its observer
    def on_step(self, preemptions: int, gauges) -> None:
        self._first.on_step(preemptions, gauges)

    def on_inter_token(self, seconds: float) -> None:
        self._first.on_inter_token(seconds)

    def on_request_finished(self, m) -> None:
        self._first.on_request_finished(m)

    def on_api_times(self, seconds: dict[str, float]) -> None:
        for phase, s in seconds.items():
            self.api_seconds.labels(model_name=self.model_name, phase=phase).observe(s)

    def render(self) -> bytes:
        return generate_latest(self.registry)


_SPEC = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_emitted_tokens",
         "draft_seconds", "verify_seconds")  # fmt: skip
# families with a label of their own beyond the engine
_LABELLED = ("per_pos", "finished", "misses", "loras")


class EngineMetrics:
    """One engine's series of the server's families, and what it last reported of its
    running counts (they arrive as totals and are counted as deltas)."""

    def __init__(self, server: ServerMetrics, index: int, model_name: str):
        self._labels = {"model_name": model_name, "engine": str(index)}
        f = server.families
        self.series = {k: v.labels(**self._labels) for k, v in f.items() if k not in _LABELLED}
        self._per_pos, self._finished, self._misses = f["per_pos"], f["finished"], f["misses"]
        self._loras, self._lora_labels = f["loras"], None
        self._spec_seen: dict = {}
        self._queried = self._hits = 0
        self._offloaded = self._restored = self._dropped = 0
        # what the web page's engine panel shows (serve/engine_panel.py): the last gauges,
        # when they came, and finished requests by why their prefix missed
        self.model_name, self.index = model_name, index
        self.last, self.last_at = None, None
        self.miss_counts: dict[str, int] = {}

    def on_state(self, gauges) -> None:
        """The engine as it is now (EngineGauges: after a step, or after requests left)."""
        self.last, self.last_at = gauges, time.time()
        s = self.series
        s["running"].set(gauges.running)
        s["waiting"].set(gauges.waiting)
        s["kv_usage"].set(gauges.kv_usage)
        if gauges.max_loras is not None:
            self._lora_info(gauges)

    def _lora_info(self, gauges) -> None:
        """The adapter gauge's one series for this engine, its labels as they are now."""
        labels = (str(gauges.max_loras), ",".join(gauges.running_loras),
                  ",".join(gauges.waiting_loras))  # fmt: skip
        if labels != self._lora_labels:
            if self._lora_labels is not None:
                self._loras.remove(*self._lora_labels, *self._labels.values())
            self._lora_labels = labels
        self._loras.labels(*labels, *self._labels.values()).set(time.time())

    def on_step(self, preemptions: int, gauges) -> None:
        self.on_state(gauges)
        s = self.series
        s["preemptions"].inc(preemptions)
        if gauges.prefix_queried is not None:  # the cache's own running counts, as deltas
            s["prefix_queries"].inc(max(0, gauges.prefix_queried - self._queried))
            s["prefix_hits"].inc(max(0, gauges.prefix_hits - self._hits))
            self._queried, self._hits = gauges.prefix_queried, gauges.prefix_hits
        if gauges.offloaded_blocks is not None:  # the host tier's running counts
            s["offloaded"].inc(max(0, gauges.offloaded_blocks - self._offloaded))
            s["restored"].inc(max(0, gauges.restored_blocks - self._restored))
            s["offload_bytes"].set(gauges.offload_bytes)
            s["offload_dropped"].inc(max(0, gauges.offload_dropped_blocks - self._dropped))
            self._offloaded, self._restored = gauges.offloaded_blocks, gauges.restored_blocks
            self._dropped = gauges.offload_dropped_blocks
        if gauges.speculation is not None:
            self._count_speculation(gauges.speculation)

    def _count_speculation(self, m) -> None:
        """The speculator's running totals, as deltas since the last step; its controller's
        state as it is."""
        s = self.series
        s["spec_proposing"].set(m.proposing)
        s["spec_held_back"].set(m.held_back)
        s["spec_losing"].set(int(m.losing))
        if m.mean_acceptance is not None:
            s["spec_acceptance"].set(m.mean_acceptance)
        for name in _SPEC:
            value = getattr(m, name)
            self.series[name].inc(max(0, value - self._spec_seen.get(name, 0)))
            self._spec_seen[name] = value
        for pos, value in enumerate(m.accepted_per_pos):
            key = ("pos", pos)
            delta = value - self._spec_seen.get(key, 0)
            if delta > 0:
                self._per_pos.labels(position=str(pos), **self._labels).inc(delta)
            self._spec_seen[key] = value

    def on_inter_token(self, seconds: float) -> None:
        self.series["itl"].observe(seconds)

    def on_request_finished(self, m) -> None:
        s = self.series
        s["prompt_tokens"].inc(m.prompt_tokens)
        s["generation_tokens"].inc(m.generation_tokens)
        s["e2e"].observe(m.e2e)
        if m.ttft is not None:
            s["ttft"].observe(m.ttft)
        if m.queue_time is not None:
            s["queue"].observe(m.queue_time)
        if m.tpot is not None:
            s["tpot"].observe(m.tpot)
        for reason in m.finish_reasons:
            self._finished.labels(finished_reason=reason, **self._labels).inc()
        if m.prefix_miss is not None:
            self._misses.labels(reason=m.prefix_miss, **self._labels).inc()
            self.miss_counts[m.prefix_miss] = self.miss_counts.get(m.prefix_miss, 0) + 1
