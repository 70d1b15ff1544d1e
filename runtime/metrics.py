"""Prometheus metrics of the runtime (one definition per metric name).

Every process exposes its own ``/metrics``. Under ``eaas serve`` all children share one
``PROMETHEUS_MULTIPROC_DIR`` (prometheus-client multiprocess mode), so ``/metrics`` on the API
port carries the expert servers' series as well. The variable must be set before this module is
imported (prometheus-client picks its value class at import time).

Names (keep exact; dashboards and issues refer to them):

* ``eaas_expert_tokens_total{layer,expert,server}`` counter: expert load, counted on the expert
  server ``server`` (its ``--server-id``): the (token, expert) pairs it computed for that logical
  expert, real tokens only (padding ids ``-1`` and rows refused or malformed are not counted; no
  forward of the runtime's own, warm-up, graph capture or health probe, reaches it).
* ``eaas_expert_server_batch_tokens`` histogram: tokens per dynamic batch on a server.
* ``eaas_dispatch_seconds`` histogram: client-side round trip of one MoE layer call
  (dispatch + combine, all servers, including failover).
* ``eaas_failovers_total`` counter: token batches re-sent to another replica.
* ``eaas_ttft_seconds`` / ``eaas_itl_seconds`` histograms: time to first token, inter-token latency.
* ``eaas_kv_cache_blocks{client_id,state}`` / ``eaas_kv_cache_bytes{client_id}`` gauges and
  ``eaas_preemptions_total{client_id}``: the attention client's paged KV cache.
"""

from __future__ import annotations

import os

from prometheus_client import (
    CONTENT_TYPE_LATEST,  # noqa: F401  (re-export)
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.5,
    1.0,
    2.0,
    5.0,
    10.0,
)
_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)

EXPERT_TOKENS = Counter(
    "eaas_expert_tokens",
    "Tokens computed per (layer, logical expert) on an expert server (real tokens only)",
    ["layer", "expert", "server"],
)
SERVER_BATCH_TOKENS = Histogram(
    "eaas_expert_server_batch_tokens",
    "Tokens per dynamic batch on an expert server",
    buckets=_TOKEN_BUCKETS,
)
SERVER_FRAMES = Counter("eaas_expert_server_frames", "Request frames served by expert servers")
DISPATCH_SECONDS = Histogram(
    "eaas_dispatch_seconds",
    "Client-side round trip of one MoE layer call",
    buckets=_LATENCY_BUCKETS,
)
FAILOVERS = Counter(
    "eaas_failovers", "Token batches re-sent to another replica after a server failure"
)
SERVER_DOWN = Counter(
    "eaas_server_marked_down", "Expert servers marked down by attention clients", ["server"]
)
TTFT_SECONDS = Histogram("eaas_ttft_seconds", "Time to first token", buckets=_LATENCY_BUCKETS)
ITL_SECONDS = Histogram("eaas_itl_seconds", "Inter-token latency", buckets=_LATENCY_BUCKETS)
REQUESTS = Counter(
    "eaas_requests",
    "Completion and chat requests by outcome: HTTP status (200, 400, 404, 500, 503) or cancelled",
    ["client_id", "status"],
)
RUNNING_SEQS = Gauge(
    "eaas_running_sequences",
    "Sequences in the decode batch",
    ["client_id"],
    multiprocess_mode="livesum",
)
WAITING_SEQS = Gauge(
    "eaas_waiting_sequences",
    "Sequences admitted to an attention client but not in its decode batch yet (or preempted)",
    ["client_id"],
    multiprocess_mode="livesum",
)
KV_CACHE_BLOCKS = Gauge(
    "eaas_kv_cache_blocks",
    "Paged KV-cache blocks of an attention client (state: total, used)",
    ["client_id", "state"],
    multiprocess_mode="livesum",
)
KV_CACHE_BYTES = Gauge(
    "eaas_kv_cache_bytes",
    "Preallocated KV-cache memory of an attention client",
    ["client_id"],
    multiprocess_mode="livesum",
)
PREEMPTIONS = Counter(
    "eaas_preemptions",
    "Sequences preempted (KV cache full; recomputed when readmitted)",
    ["client_id"],
)
ROUTING_TABLE_VERSION = Gauge(
    "eaas_routing_table_version",
    "Routing table version in use",
    ["client_id"],
    multiprocess_mode="max",
)


def multiprocess_dir() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


def render_latest() -> bytes:
    """Exposition text: merged over all processes in multiprocess mode, else this process's."""
    mp = multiprocess_dir()
    if mp:
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=mp)
        return generate_latest(registry)
    from prometheus_client import REGISTRY

    return generate_latest(REGISTRY)
