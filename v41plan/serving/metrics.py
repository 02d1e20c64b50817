"""Prometheus metrics of the server: vLLM's names under a ``v41plan:`` prefix.

``ServerMetrics(engine_snapshot, model_name)`` owns one ``CollectorRegistry`` (so several
servers can live in one process) and is the ``AsyncEngine``'s metrics sink. Gauges and the
step counters are read from the engine's latest snapshot at scrape time; request counters and
histograms are observed on the engine thread as requests progress.

Gauges: ``v41plan:num_requests_running`` / ``num_requests_waiting`` (the scheduler's queues),
``v41plan:kv_cache_usage_perc`` (PAGE pool in use, block tables and images, 0..1),
``v41plan:state_cache_usage_perc`` (STATE slots in use, 0..1), ``v41plan:num_pages_in_use`` /
``num_pages_images`` / ``num_pages_total`` (PAGEs held by block tables / by checkpoint images /
all) and ``v41plan:num_slots_in_use`` / ``num_slots_total``.

Counters: ``v41plan:prefix_cache_queries_total`` / ``prefix_cache_hits_total`` (prompt tokens
looked up / found, per admission), ``v41plan:prompt_tokens_total`` /
``generation_tokens_total`` (tokens of finished requests),
``v41plan:request_success_total{finished_reason}`` (finished choices by reason),
``v41plan:engine_steps_total``, ``v41plan:runner_<name>_total`` (the runner's step counters:
forwards, rows, replay rows, ...), ``v41plan:cudagraph_replays_total`` and
``v41plan:eager_decode_steps_total`` (0 under eager execution). With speculative decoding:
``v41plan:spec_decode_num_drafts_total`` (blocks verified),
``v41plan:spec_decode_num_draft_tokens_total`` (tokens drafted),
``v41plan:spec_decode_num_accepted_tokens_total`` (drafted tokens accepted),
``v41plan:spec_decode_num_proposals_total`` (blocks drafted) and
``v41plan:spec_decode_accepted_length_total{accepted_len}`` (blocks by accepted length, the
histogram of accepted lengths).

Histograms: ``v41plan:time_to_first_token_seconds``, ``inter_token_latency_seconds``,
``e2e_request_latency_seconds`` and ``request_queue_time_seconds``.
"""

from __future__ import annotations

from collections.abc import Callable

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0,
)  # fmt: skip
_GAUGES = {
    "num_requests_running": "Requests running in the engine.",
    "num_requests_waiting": "Requests waiting to be admitted.",
    "num_pages_in_use": "PAGEs referenced by block tables.",
    "num_pages_images": "PAGEs holding checkpoint images (copy transfer).",
    "num_pages_total": "PAGEs of the pool.",
    "num_slots_in_use": "STATE slots held by requests.",
    "num_slots_total": "STATE slots of the pool.",
}


SPEC_COUNTERS = {
    "spec_verify_rows": ("spec_decode_num_drafts", "Draft blocks verified."),
    "spec_drafted": ("spec_decode_num_draft_tokens", "Tokens drafted."),
    "spec_accepted": ("spec_decode_num_accepted_tokens", "Drafted tokens accepted."),
    "spec_proposals": ("spec_decode_num_proposals", "Draft blocks proposed."),
}
"""Runner counters of speculative decoding -> (metric, help)."""
_LEN_PREFIX = "spec_accepted_len_"


class ServerMetrics:
    """The ``v41plan:`` metrics of one server (an ``AsyncEngine`` metrics sink)."""

    def __init__(self, snapshot: Callable[[], dict], model_name: str) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        self._snapshot = snapshot
        self.model_name = model_name
        labels = ["model_name"]
        r = self.registry

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()):
            return Counter(f"v41plan:{name}", doc, labels + list(extra), registry=r)

        def histogram(name: str, doc: str):
            return Histogram(
                f"v41plan:{name}", doc, labels, buckets=_LATENCY_BUCKETS, registry=r
            ).labels(model_name)

        self.prefix_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        ).labels(model_name)
        self.prefix_hits = counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache."
        ).labels(model_name)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.").labels(
            model_name
        )
        self.generation_tokens = counter(
            "generation_tokens", "Generated tokens of finished requests."
        ).labels(model_name)
        self.success = counter(
            "request_success", "Finished choices by finish reason.", ("finished_reason",)
        )
        for reason in ("stop", "length", "abort", "error"):
            self.success.labels(model_name, reason)
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.")
        self.itl = histogram("inter_token_latency_seconds", "Time between two tokens.")
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token.")
        self.queue = histogram("request_queue_time_seconds", "Arrival to admission.")
        r.register(_SnapshotCollector(self))

    # ---- the AsyncEngine sink ---------------------------------------------------------------
    def observe_request(self, handle, reasons: list[str]) -> None:
        """A request finished: tokens, reasons and end-to-end latency."""
        self.prompt_tokens.inc(len(handle.prompt_ids))
        self.generation_tokens.inc(handle.completion_tokens)
        for reason in reasons:
            self.success.labels(self.model_name, reason).inc()
        if handle.finished is not None:
            self.e2e.observe(handle.finished - handle.arrival)

    def observe_tokens(self, handle, new_tokens: int, now: float) -> None:
        """New tokens: the first one's latency, then the gaps between tokens."""
        if handle.first_token is None:
            self.ttft.observe(now - handle.arrival)
        elif handle.last_token is not None:
            self.itl.observe(now - handle.last_token)

    def observe_prefix(self, queried_tokens: int, hit_tokens: int) -> None:
        """One admission's prefix-cache lookup."""
        self.prefix_queries.inc(queried_tokens)
        self.prefix_hits.inc(hit_tokens)

    def observe_queue(self, handle) -> None:
        """A request was admitted."""
        if handle.admitted is not None:
            self.queue.observe(max(0.0, handle.admitted - handle.arrival))

    def render(self) -> bytes:
        """The text exposition of every metric."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class _SnapshotCollector:
    """Gauges and step counters read from the engine's latest snapshot at scrape time."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.m = metrics

    def describe(self):
        """Nothing up front: the families depend on the runner's counters."""
        return []

    def collect(self):
        """One family per gauge and per step counter."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        snap = self.m._snapshot() or {}
        name = self.m.model_name
        for key, doc in _GAUGES.items():
            g = GaugeMetricFamily(f"v41plan:{key}", doc, labels=["model_name"])
            g.add_metric([name], float(snap.get(key, 0)))
            yield g
        for key, doc in (
            ("kv_cache_usage_perc", "PAGE pool usage (block tables and images), 0..1."),
            ("state_cache_usage_perc", "STATE slot usage, 0..1."),
        ):
            src = "page_cache_usage_perc" if key == "kv_cache_usage_perc" else key
            g = GaugeMetricFamily(f"v41plan:{key}", doc, labels=["model_name"])
            g.add_metric([name], float(snap.get(src, 0.0)))
            yield g
        c = CounterMetricFamily("v41plan:engine_steps", "Engine steps.", labels=["model_name"])
        c.add_metric([name], float(snap.get("engine_steps", 0)))
        yield c
        counters = dict(snap.get("step_counters", {}))
        named = {
            "graph_replays": ("cudagraph_replays", "CUDA-graph replays."),
            "graph_eager_decode_steps": ("eager_decode_steps", "Decode steps run eagerly."),
        }
        for key, (metric, doc) in named.items():
            c = CounterMetricFamily(f"v41plan:{metric}", doc, labels=["model_name"])
            c.add_metric([name], float(counters.pop(key, 0)))
            yield c
        if "spec_verify_rows" in counters:
            for key, (metric, doc) in SPEC_COUNTERS.items():
                c = CounterMetricFamily(f"v41plan:{metric}", doc, labels=["model_name"])
                c.add_metric([name], float(counters.pop(key, 0)))
                yield c
            c = CounterMetricFamily(
                "v41plan:spec_decode_accepted_length",
                "Verified draft blocks by accepted length.",
                labels=["model_name", "accepted_len"],
            )
            lens = {k: counters.pop(k) for k in list(counters) if k.startswith(_LEN_PREFIX)}
            for key in sorted(lens, key=lambda k: int(k[len(_LEN_PREFIX) :])):
                c.add_metric([name, key[len(_LEN_PREFIX) :]], float(lens[key]))
            yield c
        for key, value in sorted(counters.items()):
            metric = key if key.startswith("graph_") else f"runner_{key}"
            c = CounterMetricFamily(
                f"v41plan:{metric}", f"Runner counter {key}.", labels=["model_name"]
            )
            c.add_metric([name], float(value))
            yield c
