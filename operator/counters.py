"""Counters of the work the operator does (monotonic, since the process started), served on
``GET /metrics`` of the report listener (:func:`eaas.operator.reconcile.reports.operator_metrics`)
so that a test or a benchmark can count work instead of timing it.

* ``eaas_operator_watch_events_total{resource}``: watch events handled (``pods``, ``nodes``,
  ``configmaps``; the kopf handlers count them).
* ``eaas_operator_reconcile_steps_total{kind}``: full reconcile steps run (``pool``, ``fleet``).
* ``eaas_operator_pod_lists_total``: pool steps that LISTed their pods (the others read the
  pod index the watch keeps).
* ``eaas_operator_table_writes_total``: routing-table ConfigMap writes.
* ``eaas_operator_table_drops_total``: of those, dead servers dropped from the table in force
  before the step (:mod:`eaas.operator.reconcile.death`).
* ``eaas_operator_idle_steps_skipped_total``: idle resync steps skipped, nothing they read
  having changed (:mod:`eaas.operator.resync`).
* ``eaas_operator_load_scrapes_total{result}``: ``GET /metrics`` of expert servers by the load
  scraper (:mod:`eaas.operator.load`), ``ok`` or ``failed``.
* ``eaas_operator_api_calls_total{method, resource}``: Kubernetes API requests made through the
  operator's ``ApiClient`` (:class:`CountingApiClient`; kopf's own watches are not counted),
  ``resource`` the plural in the URL (``pods``, ``configmaps``, ``leases``, ``events``, ...).
"""

from __future__ import annotations

import collections
import threading
from typing import Any
from urllib.parse import urlsplit

from kubernetes import client as k8s


def url_resource(url: str) -> str:
    """The resource plural of a Kubernetes API URL: ``/api/v1/namespaces/ns/pods/x/status`` ->
    ``pods``, ``/apis/eaas.io/v1alpha1/namespaces/ns/expertpools`` -> ``expertpools``,
    ``/api/v1/nodes`` -> ``nodes`` ("" when the path is not an API path)."""
    parts = [p for p in urlsplit(url).path.split("/") if p]
    if parts[:1] == ["api"]:
        rest = parts[2:]  # api, v1
    elif parts[:1] == ["apis"]:
        rest = parts[3:]  # apis, group, version
    else:
        return ""
    if len(rest) >= 3 and rest[0] == "namespaces":
        return rest[2]
    return rest[0] if rest else ""


class WorkCounters:
    """Thread-safe monotonic counters (reconcile steps run in worker threads, watch handlers on
    kopf's event loop). Keys are ``(metric name, sorted label pairs)``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: collections.Counter[tuple[str, tuple[tuple[str, str], ...]]] = (
            collections.Counter()
        )

    def add(self, name: str, n: int = 1, **labels: str) -> None:
        """Add ``n`` to counter ``name`` with ``labels``."""
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            self._values[key] += n

    def get(self, name: str, **labels: str) -> int:
        """The value of counter ``name``: the sum over every label set that contains
        ``labels`` (0 when never added)."""
        want = set(labels.items())
        with self._lock:
            return sum(v for (n, ls), v in self._values.items() if n == name and want <= set(ls))

    def exposition(self) -> list[str]:
        """Prometheus text lines (``# TYPE`` and one sample per label set), sorted."""
        with self._lock:
            items = sorted(self._values.items())
        lines: list[str] = []
        typed: set[str] = set()
        for (name, labels), value in items:
            if name not in typed:
                typed.add(name)
                lines.append(f"# TYPE {name} counter")
            text = ",".join(f'{k}="{v}"' for k, v in labels)
            lines.append(f"{name}{{{text}}} {value}" if text else f"{name} {value}")
        return lines


class CountingApiClient(k8s.ApiClient):
    """A kubernetes-client ``ApiClient`` that counts every request it makes in ``counters``
    (``eaas_operator_api_calls_total{method, resource}``)."""

    def __init__(self, counters: WorkCounters, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.counters = counters

    def call_api(self, method: Any, url: Any, *args: Any, **kwargs: Any) -> Any:
        """Count, then make the request (``ApiClient.call_api``)."""
        self.counters.add(
            "eaas_operator_api_calls_total", method=str(method), resource=url_resource(str(url))
        )
        return super().call_api(method, url, *args, **kwargs)
