"""Failure reports: an attention client tells the monitor (the operator) which expert server it
marked down (liveness in Kubernetes: the operator confirms with its own probe).

When the :class:`~eaas.runtime.client.dispatch.Dispatcher` marks a server down (a send or receive
failed, the deadline passed, an error status), :meth:`FailureReporter.report` is called under the
dispatcher's lock: it only enqueues (``put_nowait`` on a bounded queue, :data:`QUEUE_SIZE`
reports; on overflow the report is dropped and counted), so the request path never waits on the
monitor. A daemon thread POSTs each report as JSON to ``--failure-report-url``::

    {"client_id": "0", "server_id": "pool-3", "endpoint": "tcp://127.1.0.7:9000",
     "table_version": 12, "reason": "recv: PeerDeadError: ...", "time": 1764470000.123}

with ``Authorization: Bearer <token>`` (the push token, ``--push-token-file``), a timeout of
``timeout_s`` (default 2 s) and no retry: the operator confirms with its own probe, and the next
failure reports again. Outcomes are counted in ``eaas_failure_reports_total{outcome}`` with
outcome ``sent`` / ``failed`` (receiver unreachable or non-2xx) / ``dropped`` (queue full).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from typing import Any

from prometheus_client import Counter

from eaas.runtime.tables.http import json_call
from eaas.runtime.tables.push import BearerToken

log = logging.getLogger("eaas.client.report")

QUEUE_SIZE = 256

FAILURE_REPORTS = Counter(
    "eaas_failure_reports", "Expert-server failure reports by attention clients", ["outcome"]
)


def failure_report(
    client_id: str, server_id: str, endpoint: str, table_version: int, reason: str, now: float
) -> dict[str, Any]:
    """The JSON body of one report (see the module docstring)."""
    return {
        "client_id": str(client_id),
        "server_id": server_id,
        "endpoint": endpoint,
        "table_version": int(table_version),
        "reason": reason,
        "time": round(now, 3),
    }


class FailureReporter:
    """Bounded, non-blocking sender of failure reports.

    Args:
        url: the monitor's HTTP(S) endpoint (POST).
        client_id: this attention client's id.
        token: bearer token source (None: no ``Authorization`` header).
        timeout_s: per-POST timeout (s).
        queue_size: reports held while the sender is busy; more are dropped.

    Raises:
        ValueError: ``url`` is not ``http://`` or ``https://``.
    """

    def __init__(
        self,
        url: str,
        client_id: str,
        token: BearerToken | None = None,
        *,
        timeout_s: float = 2.0,
        queue_size: int = QUEUE_SIZE,
    ):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--failure-report-url must be http:// or https://, got {url!r}")
        self.url = url
        self.client_id = str(client_id)
        self.token = token
        self.timeout_s = float(timeout_s)
        self._q: queue.Queue[dict | None] = queue.Queue(maxsize=queue_size)
        self.sent = self.failed = self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="eaas-failure-report", daemon=True)

    def start(self) -> FailureReporter:
        self._thread.start()
        return self

    def report(self, server_id: str, endpoint: str, table_version: int, reason: str) -> bool:
        """Queue one report; never blocks. Returns False when it was dropped (queue full)."""
        body = failure_report(
            self.client_id, server_id, endpoint, table_version, reason, time.time()
        )
        try:
            self._q.put_nowait(body)
        except queue.Full:
            self.dropped += 1
            FAILURE_REPORTS.labels(outcome="dropped").inc()
            return False
        return True

    def close(self, timeout: float = 2.0) -> None:
        """Stop the sender after the reports already queued (waits at most ``timeout`` s)."""
        try:
            self._q.put(None, timeout=timeout)
        except queue.Full:
            pass
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            body = self._q.get()
            if body is None:
                return
            try:
                self._post(body)
                self.sent += 1
                FAILURE_REPORTS.labels(outcome="sent").inc()
            except Exception as exc:  # noqa: BLE001  (unreachable monitor: log, drop, go on)
                self.failed += 1
                FAILURE_REPORTS.labels(outcome="failed").inc()
                log.warning(
                    "failure report for %s to %s failed: %s", body["server_id"], self.url, exc
                )

    def _post(self, body: dict) -> None:
        """POST one report. Raises OSError: unreachable or an HTTP error status."""
        token = self.token.get() if self.token is not None else None
        status, _, message = json_call(
            "POST", self.url, json.dumps(body).encode(), token, self.timeout_s
        )
        if status >= 400:
            raise OSError(f"HTTP {status}: {message}")
