"""HTTP side port of an expert server: ``GET /health`` and ``GET /metrics``.

An expert pod's readiness and liveness probes need more than an open data-plane port: a frozen
server (SIGSTOP, a hung loop) keeps accepting TCP connections into the kernel's backlog for
minutes. So ``/health`` looks at the serving loop itself:

* ``200`` ``{"status": "ok", ...}`` only when (1) the hosted experts' weights are loaded, (2) the
  data-plane listener is bound (it accepts from construction until the loop ends), and (3) the
  serving loop's last iteration (``ExpertServer.last_iteration``, ``time.monotonic()`` seconds,
  updated every turn; one turn lasts at most ``poll_timeout`` = 0.2 s plus one dynamic batch) is
  at most ``stale_after_s`` old (default :data:`DEFAULT_STALE_AFTER_S`).
* ``503`` ``{"status": "loading" | "not-ready", "reason": ...}`` otherwise, naming the failed
  check.
* A stopped process (SIGSTOP) answers nothing at all: this thread is frozen with the loop, so the
  probe's own timeout fires. A loop that hangs while the process runs turns ``/health`` to 503
  within ``stale_after_s`` plus one probe period.

``GET /routing-table``, ``PUT /routing-table`` and ``POST /routing-table/release``: the
server's side of the routing table when it learns its experts from it
(:class:`eaas.runtime.server.assignment.TableEndpoint`; 404 ``no_routing_table`` for a server started
with fixed ``--experts``). ``/health`` then also carries ``routing_table`` (assigned and
weights versions).

``GET /metrics`` is the Prometheus text of THIS process (the default registry; under
``PROMETHEUS_MULTIPROC_DIR`` each value is this process's own) plus two gauges of this module:
``eaas_expert_server_ready`` (1/0, the ``/health`` verdict) and
``eaas_expert_server_loop_age_seconds`` (seconds since the loop's last iteration; -1 before it
started); with experts from the routing table also ``eaas_expert_server_assigned_version`` and
``eaas_expert_server_weights_version``.

The server is the standard library's ``ThreadingHTTPServer`` on a daemon thread: no event loop
to share with the data plane, a few hundred microseconds per probe.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from eaas.runtime.tables.push import MAX_TABLE_BYTES, PushError, too_large

DEFAULT_STALE_AFTER_S = 5.0


@dataclass(frozen=True)
class HealthVerdict:
    """Result of :func:`health_verdict`: ``ready`` and a short ``status`` / ``reason``."""

    ready: bool
    status: str  # "ok" | "loading" | "not-ready"
    reason: str
    loop_age_s: float | None


def health_verdict(
    *,
    weights_loaded: bool,
    listening: bool,
    last_iteration: float | None,
    now: float,
    stale_after_s: float,
) -> HealthVerdict:
    """Decide an expert server's readiness (pure).

    Args:
        weights_loaded: every hosted expert's weights are in memory.
        listening: the data-plane listener is bound and the loop has not ended.
        last_iteration: ``time.monotonic()`` of the serving loop's last turn (None: not started).
        now: ``time.monotonic()`` now.
        stale_after_s: the largest loop age (s) still counted as alive.

    Returns:
        :class:`HealthVerdict`; ``loop_age_s`` is ``now - last_iteration`` (None if not started).
    """
    age = None if last_iteration is None else max(0.0, now - last_iteration)
    if not weights_loaded:
        return HealthVerdict(False, "loading", "expert weights are loading", age)
    if not listening:
        return HealthVerdict(False, "not-ready", "data-plane listener is not accepting", age)
    if age is None:
        return HealthVerdict(False, "not-ready", "serving loop has not started", age)
    if age > stale_after_s:
        return HealthVerdict(
            False,
            "not-ready",
            f"serving loop's last iteration was {age:.1f} s ago (limit {stale_after_s:g} s)",
            age,
        )
    return HealthVerdict(True, "ok", "", age)


class ServerHealth:
    """What ``/health`` reads: set by the expert-server process as it starts and stops.

    Attributes:
        server_id: id shown in the JSON answer.
        server: the :class:`~eaas.runtime.server.server.ExpertServer` once its weights are loaded
            and its listener is bound (None while loading).
        stopping: set when the serving loop has ended (listener closed).
        stale_after_s: see :func:`health_verdict`.
    """

    def __init__(self, server_id: str, stale_after_s: float = DEFAULT_STALE_AFTER_S):
        if not stale_after_s > 0:
            raise ValueError(f"stale_after_s must be > 0, got {stale_after_s!r}")
        self.server_id = server_id
        self.server: Any = None
        self.stopping = False
        # eaas.runtime.server.assignment.TableEndpoint when the server learns its experts from the
        # routing table (PUT /routing-table, POST /routing-table/release, GET /routing-table)
        self.table: Any = None
        self.stale_after_s = float(stale_after_s)

    def attach(self, server: Any) -> None:
        """Weights are loaded and the listener is bound: ``server`` is the ExpertServer."""
        self.server = server

    def verdict(self) -> HealthVerdict:
        s = self.server
        return health_verdict(
            weights_loaded=s is not None,
            listening=s is not None and not self.stopping,
            last_iteration=getattr(s, "last_iteration", None),
            now=time.monotonic(),
            stale_after_s=self.stale_after_s,
        )

    def body(self) -> dict:
        v = self.verdict()
        s = self.server
        out: dict[str, Any] = {
            "status": v.status,
            "server_id": self.server_id,
            "loop_age_s": None if v.loop_age_s is None else round(v.loop_age_s, 3),
            "stale_after_s": self.stale_after_s,
        }
        if v.reason:
            out["reason"] = v.reason
        if s is not None:
            out["endpoint"] = s.endpoint
            out["experts"] = s.num_experts
            out["stats"] = dict(s.stats)
            if hasattr(s, "traffic"):
                out["traffic"] = s.traffic.describe()
            if hasattr(s, "compute_info"):
                out["compute"] = s.compute_info()
        if self.table is not None:
            out["routing_table"] = self.table.assignment.describe()
        return out


def _own_metrics(health: ServerHealth) -> bytes:
    class _Collector:
        def collect(self):
            v = health.verdict()
            yield GaugeMetricFamily(
                "eaas_expert_server_ready",
                "1 when /health answers 200 (weights loaded, listener bound, loop recent)",
                value=1.0 if v.ready else 0.0,
            )
            yield GaugeMetricFamily(
                "eaas_expert_server_loop_age_seconds",
                "Seconds since the serving loop's last iteration (-1: not started)",
                value=-1.0 if v.loop_age_s is None else v.loop_age_s,
            )
            if health.table is not None:  # experts learnt from the routing table
                a = health.table.assignment
                yield GaugeMetricFamily(
                    "eaas_expert_server_assigned_version",
                    "Newest routing-table version this server received",
                    value=float(a.version),
                )
                yield GaugeMetricFamily(
                    "eaas_expert_server_weights_version",
                    "Newest routing-table version whose experts' weights this server holds",
                    value=float(a.weights_version),
                )

    reg = CollectorRegistry()
    reg.register(_Collector())
    return generate_latest(reg)


def _make_handler(health: ServerHealth) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "eaas-expert-server"

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            path = self.path.split("?", 1)[0]
            if path in ("/health", "/healthz", "/readyz", "/livez"):
                v = health.verdict()
                self._send(200 if v.ready else 503, json.dumps(health.body()), "application/json")
            elif path == "/routing-table":
                if health.table is None:
                    self._no_table()
                else:
                    body = health.table.assignment.describe()
                    self._send(200, json.dumps(body), "application/json")
            elif path == "/metrics":
                self._send(
                    200, generate_latest(REGISTRY) + _own_metrics(health), CONTENT_TYPE_LATEST
                )
            else:
                self._send(
                    404,
                    json.dumps({"error": f"no route {path!r}; try /health or /metrics"}),
                    "application/json",
                )

        def _table_call(self, method: str) -> None:
            path = self.path.split("?", 1)[0]
            routes = {
                ("PUT", "/routing-table"): "put",
                ("POST", "/routing-table/release"): "release",
            }
            name = routes.get((method, path))
            if name is None:
                self._send(
                    404 if path not in ("/routing-table", "/routing-table/release") else 405,
                    json.dumps({"error": f"no route {method} {path!r}"}),
                    "application/json",
                )
                return
            if health.table is None:
                self._no_table()
                return
            length = self.headers.get("Content-Length") or "0"
            if not length.strip().isdigit():  # int() would raise, the connection would drop
                self._error(
                    PushError(
                        400,
                        f"Content-Length must be a byte count, got {length!r}",
                        "invalid_routing_table",
                    )
                )
                return
            n = int(length)
            if n > MAX_TABLE_BYTES:  # refused before reading: read(n) allocates n bytes at once
                self.close_connection = True
                self._error(too_large())
                return
            raw = self.rfile.read(n) if n > 0 else b""
            code, body = getattr(health.table, name)(self.headers.get("Authorization"), raw)
            self._send(code, json.dumps(body), "application/json")

        def _error(self, refusal: PushError) -> None:
            status, body = refusal.answer()
            self._send(status, json.dumps(body), "application/json")

        def _no_table(self) -> None:
            self._error(
                PushError(
                    404,
                    "this expert server's experts are fixed (--experts); start it with "
                    "--push-token-file or --routing-table-configmap to learn them from the "
                    "routing table",
                    "no_routing_table",
                )
            )

        def do_PUT(self) -> None:  # noqa: N802
            self._table_call("PUT")

        def do_POST(self) -> None:  # noqa: N802
            self._table_call("POST")

        def _send(self, code: int, body: str | bytes, ctype: str) -> None:
            data = body.encode() if isinstance(body, str) else body
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # probes every few s: quiet
            pass

    return Handler


class ServerHTTP:
    """``/health`` + ``/metrics`` on ``host:port`` in a daemon thread.

    Args:
        health: the state ``/health`` reads.
        port: TCP port (0: any free port; see :attr:`port`).
        host: bind address (a pod binds its pod IP or ``0.0.0.0``).

    Raises:
        OSError: the port is taken.
    """

    def __init__(self, health: ServerHealth, port: int, host: str = "0.0.0.0"):
        self.health = health
        self._httpd = ThreadingHTTPServer((host, int(port)), _make_handler(health))
        self._httpd.daemon_threads = True
        self.port = int(self._httpd.server_address[1])
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="eaas-server-http", daemon=True
        )

    def start(self) -> ServerHTTP:
        self._thread.start()
        return self

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
