"""Prometheus metrics of a server: its own and the engine's, read at scrape time; and the same
quantities under vLLM's names, which cluster routers read (the Gateway API Inference Extension's
endpoint picker, llm-d): queue and running counts, the adapters in use (``vllm:lora_requests_info``),
time to first token and per output token."""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

# vLLM's histogram buckets for the two latencies (vllm/v1/metrics/loggers.py), so dashboards built
# on its quantiles read the same.
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0)


class Metrics:
    """Prometheus metrics in a registry of their own: the engine's figures read at scrape time
    (engine.metrics, queue_length(), running()) plus the server's own counters."""

    def __init__(self, engine, model_id: str):
        self.engine, self.model_id = engine, model_id
        self.registry = CollectorRegistry()
        self.registry.register(self)
        self.vllm = {"model_name": model_id, "engine": "0"}  # the labels vLLM puts on its engine's series
        self.http = Counter("hf_invisiblelora_http_requests", "HTTP requests by endpoint and status code.",
                            ["endpoint", "status"], registry=self.registry)
        self.finished = Counter("hf_invisiblelora_requests_finished",
                                "Completions finished, by finish reason (stop, length, cancelled, error).",
                                ["finish_reason"], registry=self.registry)
        self.prompt_tokens = Counter("hf_invisiblelora_prompt_tokens", "Prompt tokens of submitted requests.",
                                     registry=self.registry)
        buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
        self.ttft = Histogram("hf_invisiblelora_time_to_first_token_seconds",
                              "From submission to the first committed tokens.", buckets=buckets, registry=self.registry)
        self.latency = Histogram("hf_invisiblelora_request_latency_seconds",
                                 "From submission to the end of the request.", buckets=buckets, registry=self.registry)
        self.tpot = Histogram("hf_invisiblelora_time_per_output_token_seconds",
                              "Per request: from its first committed tokens to its last, per token after the first.",
                              buckets=buckets, registry=self.registry)
        labels = list(self.vllm)
        self.vllm_ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                                   labels, buckets=VLLM_TTFT_BUCKETS, registry=self.registry).labels(**self.vllm)
        self.vllm_tpot = Histogram("vllm:time_per_output_token_seconds",
                                   "Histogram of time per output token in seconds.", labels,
                                   buckets=VLLM_TPOT_BUCKETS, registry=self.registry).labels(**self.vllm)

    def first_token(self, seconds: float) -> None:
        """A completion's time to first token, under both names."""
        self.ttft.observe(seconds)
        self.vllm_ttft.observe(seconds)

    def per_output_token(self, seconds: float) -> None:
        """A finished request's time per output token (after the first), under both names."""
        self.tpot.observe(seconds)
        self.vllm_tpot.observe(seconds)

    def snapshot(self) -> dict:
        return self.engine.metrics_snapshot()

    def collect(self):
        m = self.snapshot()
        yield CounterMetricFamily("hf_invisiblelora_generated_tokens",
                                  "Tokens committed to requests (tokens/s: its rate).", value=m.get("tokens", 0))
        yield CounterMetricFamily("hf_invisiblelora_requests", "Requests admitted into a row of the engine.",
                                  value=m.get("requests", 0))
        yield CounterMetricFamily("hf_invisiblelora_cycles", "Decoder cycles run by the engine.", value=m.get("cycles", 0))
        yield CounterMetricFamily("hf_invisiblelora_failed_cycles",
                                  "Engine steps (a prefill, a decoder cycle, a delivery) that raised; the engine "
                                  "served on.",
                                  value=m.get("failed_cycles", 0))
        yield CounterMetricFamily("hf_invisiblelora_failed_requests",
                                  "Requests ended with an error by a failed engine step they were in.",
                                  value=m.get("failed_requests", 0))
        yield CounterMetricFamily("hf_invisiblelora_adapter_loads", "Adapters loaded into the model (at run time, "
                                  "or again after an eviction).", value=m.get("loads", 0))
        yield CounterMetricFamily("hf_invisiblelora_adapter_evictions",
                                  "Idle adapters unloaded to stay within --max-cpu-loras.", value=m.get("evictions", 0))
        yield GaugeMetricFamily("hf_invisiblelora_loaded_adapters", "Adapters loaded in the model now.",
                                value=m.get("loaded_adapters", 0))
        yield GaugeMetricFamily("hf_invisiblelora_prefix_cache_bytes", "Bytes of prompt blocks the prefix cache keeps.",
                                value=m.get("prefix_bytes", 0))
        yield GaugeMetricFamily("hf_invisiblelora_prefix_cache_blocks",
                                "Prompt blocks (of 16 tokens) the prefix cache keeps.", value=m.get("prefix_blocks", 0))
        yield GaugeMetricFamily("hf_invisiblelora_queue_length", "Requests waiting for a row.",
                                value=self.engine.queue_length())
        yield GaugeMetricFamily("hf_invisiblelora_running_rows", "Rows decoding a request.", value=self.engine.running())
        yield GaugeMetricFamily("hf_invisiblelora_max_batch", "Rows of the engine.", value=self.engine.limits.max_batch)
        for key, doc in (("drafted", "Draft tokens proposed for finished requests, per adapter."),
                         ("accepted", "Draft tokens the verify pass kept for finished requests, per adapter.")):
            family = CounterMetricFamily(f"hf_invisiblelora_{key}_tokens", doc, labels=["adapter"])
            for name, value in sorted(m.get(key, {}).items()):
                family.add_metric([name], value)
            yield family
        hist = m.get("k_hist", {})
        top = max([self.engine.options.num_draft_tokens, *hist])
        buckets, total = [], 0
        for k in range(top + 1):
            total += hist.get(k, 0)
            buckets.append((str(float(k)), total))
        buckets.append(("+Inf", total))
        yield HistogramMetricFamily("hf_invisiblelora_draft_tokens_per_cycle",
                                    "Tokens drafted per cycle (k; 0: a plain step), as the gate chose.",
                                    buckets=buckets, sum_value=sum(k * n for k, n in hist.items()))
        yield from self.vllm_families(m)

    def vllm_families(self, m: dict):
        """vLLM's gauges for the same quantities, labelled as vLLM labels them. ``vllm:lora_requests_info``
        is vLLM's: its value the time of the scrape, its labels the adapters of the running and the waiting
        requests (comma-separated names) and ``max_lora``, the most distinct adapters one pass serves
        (``max_loras``, else one per row); ``vllm:kv_cache_usage_perc`` is the share of the cache's rows
        held by requests (a row holds ``max_len`` slots whatever its length)."""
        engine, labels = self.engine, list(self.vllm)
        running, waiting = engine.adapters_in_use()
        for name, doc, value in (
                ("vllm:num_requests_running", "Number of requests in model execution batches.", engine.running()),
                ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", engine.queue_length()),
                ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                 engine.running() / engine.limits.max_batch)):
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric(list(self.vllm.values()), value)
            yield family
        for name, doc, key in (("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried "
                                "tokens.", "prefix_queries"),
                               ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                                "prefix_hits")):
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric(list(self.vllm.values()), m.get(key, 0))
            yield family
        family = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                   labels=["running_lora_adapters", "max_lora", "waiting_lora_adapters"])
        family.add_metric([",".join(running), str(engine.limits.max_loras or engine.limits.max_batch), ",".join(waiting)], time.time())
        yield family

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
