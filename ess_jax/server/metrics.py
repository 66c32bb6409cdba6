"""The server's Prometheus metrics (``GET /metrics``), fed by its ``EngineLoop`` (``engine.loop.LoopMetrics``):
request counters and latencies from the engine thread's outputs, the queue and cache gauges from
``Engine.usage()``, the tier's per-layer counters from ``Engine.offload_metrics()``."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TIER_COUNTERS = (("lookups", "lookups", "Top-k entries looked up"), ("hits", "hits", "Pool hits"),
                 ("misses", "misses", "Pool misses (fetched from the host)"),
                 ("h2d_bytes", "h2d_bytes", "Bytes fetched host to device"),
                 ("d2h_bytes", "decode_d2h_bytes", "Decode bytes backed up device to host"))
TIER_GAUGES = (("pool_slots_in_use", "pool_slots_in_use", "Device pool slots holding an entry"),
               ("pool_slots_total", "pool_slots_total", "Device pool slots"),
               ("host_store_bytes_in_use", "host_bytes_in_use", "Host store bytes of admitted requests"),
               ("host_store_bytes_capacity", "host_bytes_total", "Host store bytes"))


class Metrics:
    """The server's Prometheus metrics, in a registry of its own."""

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("ess_jax_requests", "Finished requests by outcome", ["outcome"], registry=r)
        self.running = Gauge("ess_jax_requests_running", "Requests holding a batch row", registry=r)
        self.waiting = Gauge("ess_jax_requests_waiting", "Requests waiting for a batch row", registry=r)
        self.prompt_tokens = Counter("ess_jax_prompt_tokens", "Prompt tokens of added requests", registry=r)
        self.generation_tokens = Counter("ess_jax_generation_tokens", "Generated tokens", registry=r)
        histogram = lambda name, text: Histogram(name, text, buckets=LATENCY_BUCKETS, registry=r)  # noqa: E731
        self.ttft = histogram("ess_jax_time_to_first_token_seconds", "Time to first token")
        self.itl = histogram("ess_jax_inter_token_latency_seconds", "Time between tokens")
        self.e2e = histogram("ess_jax_e2e_request_latency_seconds", "Request latency")
        self.pages_in_use = Gauge("ess_jax_kv_pages_in_use", "Cache pages reserved by admitted requests", registry=r)
        self.pages_total = Gauge("ess_jax_kv_pages_total", "Allocatable cache pages", registry=r)
        # the last offload_metrics() ("offload"), usage()'s tier keys and its counters ("speculative", "prefix_cache")
        self.tier: dict[str, Any] = {}
        r.register(_TierCollector(self.tier))
        r.register(_SpecCollector(self.tier))
        r.register(_PrefixCollector(self.tier))

    def added(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)

    def produced(self, out, since_added_s: float, since_last_s: float | None) -> None:
        """Time to first token, then the time per token between outputs; the outcome and latency at the end."""
        if out.new_token_ids:
            if since_last_s is None:
                self.ttft.observe(since_added_s)
            else:
                self.itl.observe(since_last_s / len(out.new_token_ids))
            self.generation_tokens.inc(len(out.new_token_ids))
        if out.finished:
            self.e2e.observe(since_added_s)
            self.requests.labels(out.finish_reason).inc()

    def usage(self, usage: dict) -> None:
        for key in ("speculative", "prefix_cache"):  # the engine's counters since it started
            if key in usage:
                self.tier[key] = usage[key]
        self.running.set(usage["rows_in_use"])
        self.waiting.set(usage["requests_waiting"])
        self.pages_in_use.set(usage["pages_in_use"])
        self.pages_total.set(usage["pages_total"])
        self.tier.update((key, usage[key]) for _, key, _ in TIER_GAUGES if key in usage)

    def offload(self, offload: dict) -> None:
        self.tier["offload"] = offload


class _SpecCollector:
    """Speculative decoding's counters from the last usage read, named as vLLM names them
    (``spec_decode_num_drafts``, ``..._num_draft_tokens``, ``..._num_accepted_tokens``, and per draft position
    ``..._num_accepted_tokens_per_pos``), once a speculative engine was read."""

    def __init__(self, tier: dict[str, Any]):
        self.tier = tier

    def collect(self):
        spec = self.tier.get("speculative")
        if spec is None:
            return
        for name, key, text in (("num_drafts", "num_drafts", "Verification steps of a request (K drafts each)"),
                                ("num_draft_tokens", "draft_tokens", "Drafted tokens verified"),
                                ("num_accepted_tokens", "accepted_tokens", "Drafted tokens accepted")):
            yield CounterMetricFamily(f"ess_jax_spec_decode_{name}", text, value=spec[key])
        per_pos = CounterMetricFamily("ess_jax_spec_decode_num_accepted_tokens_per_pos",
                                      "Drafted tokens accepted at each draft position", labels=["position"])
        for position, accepted in enumerate(spec["accepted_per_position"]):
            per_pos.add_metric([str(position)], accepted)
        yield per_pos


class _TierCollector:
    """The tier's counters and gauges from the last reads, per layer (once an offloaded engine was read)."""

    def __init__(self, tier: dict[str, Any]):
        self.tier = tier

    def collect(self):
        if "offload" not in self.tier or any(key not in self.tier for _, key, _ in TIER_GAUGES):
            return
        per_layer = self.tier["offload"]["per_layer"]
        for name, key, text in TIER_COUNTERS:
            family = CounterMetricFamily(f"ess_jax_tier_{name}", text, labels=["layer"])
            for c in per_layer:
                family.add_metric([str(c["layer"])], c[key])
            yield family
        for name, key, text in TIER_GAUGES:
            yield GaugeMetricFamily(f"ess_jax_tier_{name}", text, value=self.tier[key])


class _PrefixCollector:
    """The prefix cache's counters from the last ``usage()`` (once an engine with the prefix cache was read):
    prompt tokens that looked it up, and those found cached per tier the cached pages were read from."""

    def __init__(self, tier: dict[str, Any]):
        self.tier = tier

    def collect(self):
        prefix = self.tier.get("prefix_cache")
        if prefix is None:
            return
        yield CounterMetricFamily("ess_jax_prefix_cache_queries", "Prompt tokens that looked up the prefix cache",
                                  value=prefix["query_tokens"])
        hits = CounterMetricFamily("ess_jax_prefix_cache_hits", "Prompt tokens found in the prefix cache, by the tier "
                                   "they were read from", labels=["tier"])
        for tier, tokens in prefix["per_tier"].items():
            hits.add_metric([tier], tokens)
        yield hits
