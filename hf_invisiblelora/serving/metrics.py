"""Prometheus metrics of a server: its own and the engine's, read at scrape time."""

from __future__ import annotations


from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily


class Metrics:
    """Prometheus metrics in a registry of their own: the engine's figures read at scrape time
    (engine.metrics, queue_length(), running()) plus the server's own counters."""

    def __init__(self, engine, model_id: str):
        self.engine, self.model_id = engine, model_id
        self.registry = CollectorRegistry()
        self.registry.register(self)
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
        yield GaugeMetricFamily("hf_invisiblelora_queue_length", "Requests waiting for a row.",
                                value=self.engine.queue_length())
        yield GaugeMetricFamily("hf_invisiblelora_running_rows", "Rows decoding a request.", value=self.engine.running())
        yield GaugeMetricFamily("hf_invisiblelora_max_batch", "Rows of the engine.", value=self.engine.max_batch)
        for key, doc in (("drafted", "Draft tokens proposed for finished requests, per adapter."),
                         ("accepted", "Draft tokens the verify pass kept for finished requests, per adapter.")):
            family = CounterMetricFamily(f"hf_invisiblelora_{key}_tokens", doc, labels=["adapter"])
            for name, value in sorted(m.get(key, {}).items()):
                family.add_metric([name], value)
            yield family
        hist = m.get("k_hist", {})
        top = max([self.engine.num_draft_tokens, *hist])
        buckets, total = [], 0
        for k in range(top + 1):
            total += hist.get(k, 0)
            buckets.append((str(float(k)), total))
        buckets.append(("+Inf", total))
        yield HistogramMetricFamily("hf_invisiblelora_draft_tokens_per_cycle",
                                    "Tokens drafted per cycle (k; 0: a plain step), as the gate chose.",
                                    buckets=buckets, sum_value=sum(k * n for k, n in hist.items()))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
