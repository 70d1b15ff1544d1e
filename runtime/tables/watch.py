"""Converge from the ConfigMap through the API: an attention client (or an expert server) that
missed a push catches up by watching its pool's routing-table ConfigMap with the Kubernetes API,
not through a volume mount (which a kubelet refreshes only after its sync period, tens of
seconds).

``eaas attention-client --routing-table-configmap NAMESPACE/NAME`` runs a
:class:`ConfigMapTableWatcher`: it reads the ConfigMap once at start-up, then WATCHes it
(``fieldSelector=metadata.name=NAME``, resuming from the last ``resourceVersion``; a ``410 Gone``
re-reads it; other errors retry with back-off from 0.5 s doubling to 10 s) and hands every table
newer than the one in use to :meth:`Dispatcher.set_table` (older or equal versions are ignored:
pushes may be ahead of the ConfigMap). The table is the JSON under key
:data:`TABLE_KEY` (``data``; or ``binaryData``, base64, optionally gzip-compressed). A malformed
table is logged and skipped; the table in use stays.

Latency: a write reaches the client with the watch event (milliseconds on an idle machine; the
test bounds it by 30 s on the loaded 2-core CI machine). The same thread pair also calls
:meth:`Dispatcher.reconnect_down` every ``reconnect_interval`` s (what the file watcher does), so a
client without a ``--routing-table`` file still retries down servers without traffic.

Credentials: in-cluster service account (the pod needs ``get``/``list``/``watch`` on that
ConfigMap), else ``$KUBECONFIG`` / ``~/.kube/config``. The ``kubernetes`` package is imported
lazily, inside the functions that talk to the API: it is an optional dependency (the ``runtime``
extra) and the pure parts (:func:`parse_configmap_ref`, :func:`table_from_configmap`) are used
without it.
"""

from __future__ import annotations

import base64
import gzip
import logging
import threading
from typing import Any

from eaas.runtime.tables.table import RoutingTable
from eaas.runtime.tables.wire import RoutingTableError

log = logging.getLogger("eaas.client.table_watch")  # name kept: log filters select it

TABLE_KEY = "routing-table.json"


def parse_configmap_ref(ref: str) -> tuple[str, str]:
    """``"NAMESPACE/NAME"`` -> ``(namespace, name)``.

    Raises:
        ValueError: not exactly two non-empty parts.
    """
    parts = ref.split("/")
    if len(parts) != 2 or not all(parts):
        raise ValueError(f"--routing-table-configmap must be NAMESPACE/NAME, got {ref!r}")
    return parts[0], parts[1]


def table_from_configmap(
    cm_data: dict | None, cm_binary: dict | None, key: str = TABLE_KEY
) -> RoutingTable | None:
    """The :class:`RoutingTable` stored in a ConfigMap's ``data`` / ``binaryData`` (pure).

    Returns:
        the table, or None when the key is absent.

    Raises:
        RoutingTableError: the value is not a valid table (or not valid base64/gzip).
    """
    if cm_data and key in cm_data:
        return RoutingTable.from_json(cm_data[key])
    if cm_binary and key in cm_binary:
        try:
            raw = base64.b64decode(cm_binary[key], validate=True)
            if raw[:2] == b"\x1f\x8b":
                raw = gzip.decompress(raw)
            text = raw.decode("utf-8")
        except (ValueError, OSError, EOFError) as exc:
            raise RoutingTableError(f"binaryData[{key!r}] is not a table: {exc}") from None
        return RoutingTable.from_json(text)
    return None


def load_kube_config() -> None:
    """In-cluster config if running in a pod, else ``$KUBECONFIG`` / ``~/.kube/config``."""
    from kubernetes import config  # optional dependency (see the module docstring)

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()


class ConfigMapTableWatcher:
    """Watches one routing-table ConfigMap and applies newer versions to a dispatcher.

    Args:
        ref: ``"NAMESPACE/NAME"`` of the ConfigMap.
        dispatcher: receiver (:meth:`set_table`, :meth:`reconnect_down`, ``version``).
        key: data key holding the table JSON.
        watch_timeout_s: server-side timeout of one WATCH request (then it is renewed).
        reconnect_interval: seconds between :meth:`Dispatcher.reconnect_down` calls.

    Raises:
        ValueError: malformed ``ref``.
    """

    def __init__(
        self,
        ref: str,
        dispatcher: Any,
        key: str = TABLE_KEY,
        *,
        watch_timeout_s: int = 60,
        reconnect_interval: float = 0.5,
    ):
        self.namespace, self.name = parse_configmap_ref(ref)
        self.dispatcher = dispatcher
        self.key = key
        self.watch_timeout_s = int(watch_timeout_s)
        self.reconnect_interval = float(reconnect_interval)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._watch: Any = None
        self._api: Any = None

    def _core(self):
        if self._api is None:
            from kubernetes import client  # optional dependency (see the module docstring)

            load_kube_config()
            self._api = client.CoreV1Api()
        return self._api

    def _apply(self, data: dict | None, binary: dict | None, rv: str) -> bool:
        try:
            table = table_from_configmap(data, binary, self.key)
        except RoutingTableError as exc:
            log.warning(
                "ConfigMap %s/%s (resourceVersion %s): bad routing table, keeping version %d: %s",
                self.namespace,
                self.name,
                rv,
                self.dispatcher.version,
                exc,
            )
            return False
        if table is None:
            log.warning("ConfigMap %s/%s has no key %r", self.namespace, self.name, self.key)
            return False
        if table.version <= self.dispatcher.version:
            return False
        applied = self.dispatcher.set_table(table)
        if applied:
            log.info(
                "routing table version %d applied from ConfigMap %s/%s",
                table.version,
                self.namespace,
                self.name,
            )
        return applied

    def load_now(self) -> str | None:
        """Read the ConfigMap once and apply its table if newer.

        Returns:
            its ``resourceVersion`` (None if it does not exist yet; logged).

        Raises:
            kubernetes ConfigException: no credentials at all; ApiException other than 404.
        """
        from kubernetes.client.exceptions import ApiException  # optional dependency

        try:
            cm = self._core().read_namespaced_config_map(self.name, self.namespace)
        except ApiException as exc:
            if exc.status == 404:
                log.warning("ConfigMap %s/%s not found yet", self.namespace, self.name)
                return None
            raise
        rv = cm.metadata.resource_version
        self._apply(cm.data, cm.binary_data, rv)
        return rv

    def start(self) -> ConfigMapTableWatcher:
        for target, name in (
            (self._run_watch, "eaas-cm-watch"),
            (self._run_reconnect, "eaas-reconnect"),
        ):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()

    def _run_reconnect(self) -> None:
        while not self._stop.wait(self.reconnect_interval):
            try:
                self.dispatcher.reconnect_down()
            except Exception:  # noqa: BLE001
                log.exception("reconnect_down failed")

    def _run_watch(self) -> None:
        from kubernetes import watch  # optional dependency (see the module docstring)
        from kubernetes.client.exceptions import ApiException

        rv: str | None = None
        backoff = 0.5
        while not self._stop.is_set():
            try:
                if rv is None:
                    rv = self.load_now()
                self._watch = watch.Watch()
                kw: dict[str, Any] = {
                    "field_selector": f"metadata.name={self.name}",
                    "timeout_seconds": self.watch_timeout_s,
                    "_request_timeout": self.watch_timeout_s + 10,
                    "allow_watch_bookmarks": True,
                }
                if rv is not None:
                    kw["resource_version"] = rv
                for ev in self._watch.stream(
                    self._core().list_namespaced_config_map, self.namespace, **kw
                ):
                    if self._stop.is_set():
                        return
                    obj = ev["object"]
                    if ev["type"] == "ERROR":
                        code = obj.get("code") if isinstance(obj, dict) else None
                        if code == 410:
                            rv = None  # too old: read it again
                            break
                        raise RuntimeError(f"watch error event: {obj}")
                    if ev["type"] == "BOOKMARK":
                        # the kubernetes client hands bookmarks over undecoded (a dict): only
                        # the resourceVersion to resume from
                        md = obj.get("metadata") if isinstance(obj, dict) else None
                        rv = (md or {}).get("resourceVersion") or rv
                        continue
                    rv = obj.metadata.resource_version
                    if ev["type"] in ("ADDED", "MODIFIED"):
                        self._apply(obj.data, obj.binary_data, rv)
                backoff = 0.5
            except ApiException as exc:
                if exc.status == 410:
                    rv = None
                    continue
                log.warning("watching ConfigMap %s/%s: %s", self.namespace, self.name, exc)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)
            except Exception as exc:  # noqa: BLE001  (API server away: retry with back-off)
                if self._stop.is_set():
                    return
                log.warning("watching ConfigMap %s/%s: %r", self.namespace, self.name, exc)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)
                rv = None
