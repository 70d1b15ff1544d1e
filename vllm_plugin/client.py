"""The EaaS side of one vLLM worker process: the dispatcher and what feeds it.

One :class:`ExpertClient` per process that builds the model (vLLM's worker), created by the
first remote MoE layer (:class:`~eaas.vllm.experts.RemoteRoutedExperts`) from the
``EAAS_*`` variables (:class:`~eaas.runtime.options.vllm.VllmPluginOptions`). It holds what an
``eaas attention-client`` holds for its model's MoE layers, the same classes:

* the :class:`~eaas.runtime.client.dispatch.Dispatcher` (replica choice, frames over the shm /
  tcp / cudaipc / nvshmem transports, dispatch deadline, failover, ``NOT_HOSTED`` re-send, the
  ``eaas_dispatch_seconds`` / ``eaas_failovers_total`` / ``eaas_routing_table_version`` metrics);
* routing-table sources: a polled file (``EAAS_ROUTING_TABLE``,
  :class:`~eaas.runtime.tables.file_watch.RoutingTableWatcher`) and a watched ConfigMap
  (``EAAS_ROUTING_TABLE_CONFIGMAP``, :class:`~eaas.runtime.tables.watch.ConfigMapTableWatcher`);
  older versions are refused;
* failure reports of servers marked down (``EAAS_FAILURE_REPORT_URL``,
  :class:`~eaas.runtime.client.failure_report.FailureReporter`);
* the plugin's HTTP port (``EAAS_HTTP_PORT``, :mod:`eaas.vllm.http`): the authenticated push
  endpoint with its acknowledgement, ``/health`` and ``/metrics``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, ClassVar

import torch

from eaas.runtime.client.dispatch import Dispatcher, NoLiveReplicaError
from eaas.runtime.client.failure_report import FailureReporter
from eaas.runtime.options.vllm import VllmPluginOptions
from eaas.runtime.tables.file_watch import RoutingTableWatcher
from eaas.runtime.tables.push import BearerToken, TablePush
from eaas.runtime.tables.watch import ConfigMapTableWatcher
from eaas.runtime.transport.factory import connect as transport_connect

log = logging.getLogger("eaas.vllm")


class NoLiveReplica(RuntimeError):
    """A selected expert has no live replica and this vLLM cannot fail single requests (no
    :mod:`eaas.vllm.scheduler`): the engine step cannot be computed.

    The message starts with ``eaas: 503 no_live_replica``; vLLM's engine stops with it.
    """


#: seconds after NaN rows were written during which each layer call checks its input for them
#: (a poisoned request may run one more step under async scheduling before it is finished)
POISON_WINDOW_S = 60.0


class ExpertClient:
    """The dispatcher and its table sources of this process (see the module docstring).

    Args:
        options: the plugin's settings.
        hidden_size: ``H`` of the model (the MoE layers' input width).
        dtype: the activations' dtype (float32 or bfloat16: what the servers compute in).
        num_experts: routed experts per MoE layer (pushed tables must match).

    Raises:
        OSError / ValueError / RoutingTableError: an unreadable token file or routing table.
    """

    _instance: ClassVar[ExpertClient | None] = None
    _lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def get(cls, *, hidden_size: int, dtype: torch.dtype, num_experts: int) -> ExpertClient:
        """The process's client, created on the first call from ``os.environ``.

        Raises:
            ValueError: a later layer with another ``hidden_size`` / ``dtype`` /
                ``num_experts`` (one routing table serves one model).
        """
        with cls._lock:
            c = cls._instance
            if c is None:
                options = VllmPluginOptions.from_env(os.environ)
                c = cls._instance = cls(options, hidden_size, dtype, num_experts)
            elif (c.hidden_size, c.dtype, c.num_experts) != (hidden_size, dtype, num_experts):
                raise ValueError(
                    f"eaas.vllm: MoE layers differ (hidden {hidden_size}, {dtype}, "
                    f"{num_experts} experts vs {c.hidden_size}, {c.dtype}, {c.num_experts})"
                )
            return c

    @classmethod
    def current(cls) -> ExpertClient:
        """The process's client (created by the first MoE layer).

        Raises:
            RuntimeError: none yet (no remote MoE layer was built in this process).
        """
        c = cls._instance
        if c is None:
            raise RuntimeError("eaas.vllm: no expert client in this process (no MoE layer built)")
        return c

    @classmethod
    def reset(cls) -> None:
        """Close the process's client (if any): the next :meth:`get` reads ``os.environ``
        again. For a process that builds several models one after the other (vLLM's offline
        ``LLM`` in a test); a serving process never needs it."""
        with cls._lock:
            c, cls._instance = cls._instance, None
        if c is not None:
            c.close()

    def __init__(
        self, options: VllmPluginOptions, hidden_size: int, dtype: torch.dtype, num_experts: int
    ) -> None:
        o = self.options = options
        self.hidden_size, self.dtype, self.num_experts = int(hidden_size), dtype, int(num_experts)
        self.moe_layers: set[int] = set()
        #: end only the affected requests (NaN rows, :mod:`eaas.vllm.scheduler`) instead of
        #: raising :class:`NoLiveReplica`; set by the layers from vLLM's config
        self.fail_requests = False
        self.failed_rows = 0  # token rows answered with NaN (no live replica)
        self._poisoned_at = -POISON_WINDOW_S
        self.skipped_bytes = 0  # routed-expert checkpoint bytes the layers did not load
        self.token = BearerToken(o.push_token_file) if o.push_token_file else None
        if self.token is not None:
            self.token.get()  # a missing/empty Secret fails the start, loudly
        extra: dict[str, Any] = {}
        if o.spin_us is not None:
            extra["connect"] = _spinning_connect(o.spin_us)
        self.dispatcher = Dispatcher(
            o.numeric_client_id,
            self.hidden_size,
            dtype,
            timeout=o.dispatch_timeout,
            moe_layers=(),
            **extra,
        )
        self.reporter: FailureReporter | None = None
        if o.failure_report_url:
            self.reporter = FailureReporter(o.failure_report_url, o.client_id, self.token).start()
            self.dispatcher.on_server_down = self.reporter.report
        self.push = TablePush(
            self.dispatcher, self.token, o.client_id, self.num_experts, self.moe_layers
        )
        self.watchers: list[Any] = []
        if o.routing_table:
            w = RoutingTableWatcher(o.routing_table, self.dispatcher)
            w.load_now()
            self.watchers.append(w)
        if o.routing_table_configmap:
            cm = ConfigMapTableWatcher(o.routing_table_configmap, self.dispatcher)
            cm.load_now()
            self.watchers.append(cm)
        for w in self.watchers:
            w.start()
        self.http = None
        if o.http_port:
            from eaas.vllm.http import start_http  # lazy: FastAPI/uvicorn only with a port

            self.http = start_http(self, o.http_host, o.http_port)
        log.info(
            "eaas.vllm: client %s, routing table version %d, dispatch deadline %.1f s%s",
            o.client_id,
            self.dispatcher.version,
            o.dispatch_timeout,
            f", http://{o.http_host}:{o.http_port}" if o.http_port else "",
        )

    def add_layer(self, layer: int) -> None:
        """Record a MoE layer of the model (a table that leaves it out has it uncovered)."""
        self.moe_layers.add(int(layer))
        self.dispatcher.moe_layers = tuple(sorted(self.moe_layers))

    def run(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """One MoE layer's routed experts: ``x`` ``[T, H]``, ``topk_ids`` / ``topk_weights``
        ``[T, k]`` (any int / float dtype) -> ``[T, H]`` in ``x.dtype``.

        With :attr:`fail_requests`, the rows of tokens that selected an expert without a live
        replica (and rows that already hold NaN: tokens of a request failed in an earlier
        layer) are NaN and every other row is computed; vLLM's scheduler then ends those
        tokens' requests with an error (:mod:`eaas.vllm.scheduler`).

        Raises:
            NoLiveReplica: some selected expert has no live replica (after failover) and
                :attr:`fail_requests` is off.
        """
        if x.shape[0] == 0:
            return torch.zeros_like(x)
        x = x.contiguous()
        ids = topk_ids.to(torch.int64)
        w = topk_weights.to(torch.float32)
        bad: torch.Tensor | None = None
        if self.fail_requests and time.monotonic() - self._poisoned_at < POISON_WINDOW_S:
            nan_rows = torch.isnan(x).any(dim=1)
            if bool(nan_rows.any()):
                bad = nan_rows.cpu()
        try:
            if bad is None:
                return self.dispatcher.dispatch(layer, x, ids, w)
        except NoLiveReplicaError as exc:
            if not self.fail_requests:
                raise NoLiveReplica(f"eaas: 503 no_live_replica: {exc}") from exc
            log.error("eaas: 503 no_live_replica: %s: its tokens' requests end with an error", exc)
            bad = torch.zeros(x.shape[0], dtype=torch.bool)
        return self._run_without(layer, x, ids, w, bad)

    def _run_without(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, bad: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`run` with the rows ``bad`` ``[T]`` bool (CPU) and every row that selects an
        uncovered expert of ``layer`` answered NaN; the others dispatched (retried while
        failover finds more experts without a replica)."""
        ids_cpu = ids.cpu()
        uncovered = {u["expert"] for u in self.dispatcher.uncovered() if u["layer"] == layer}
        for _ in range(self.num_experts + 1):
            if uncovered:
                lost = torch.tensor(sorted(uncovered), dtype=torch.int64)
                bad = bad | torch.isin(ids_cpu, lost).any(dim=1)
            keep = ~bad
            if not bool(keep.any()):
                out = torch.zeros_like(x)
                break
            rows = keep.nonzero().squeeze(1).to(x.device)
            try:
                out = torch.zeros_like(x)
                out[rows] = self.dispatcher.dispatch(layer, x[rows], ids[rows], w[rows])
                break
            except NoLiveReplicaError as exc:
                uncovered.add(exc.expert)
        else:  # pragma: no cover - every expert uncovered is the loop's last round
            out = torch.zeros_like(x)
            bad = torch.ones_like(bad)
        out[bad.to(x.device)] = float("nan")
        self.failed_rows += int(bad.sum())
        self._poisoned_at = time.monotonic()
        return out

    def health(self) -> tuple[int, dict]:
        """``(HTTP status, body)`` of ``GET /health``: 503 ``degraded`` while some expert has
        no live replica or there is no routing table yet, else 200 ``ok``."""
        d = self.dispatcher
        body: dict[str, Any] = {
            "client_id": self.options.client_id,
            "engine": "vllm",
            "moe_layers": sorted(self.moe_layers),
            "routed_expert_bytes_not_loaded": self.skipped_bytes,
            "fails_requests": self.fail_requests,
            "failed_token_rows": self.failed_rows,
            **d.health(),
        }
        if d.table is None:
            body["reason"] = "no routing table yet"
            body["uncovered_experts"] = len(self.moe_layers) * self.num_experts
        ok = body["uncovered_experts"] == 0
        body["status"] = "ok" if ok else "degraded"
        return (200 if ok else 503), body

    def close(self) -> None:
        """Stop the watchers, the reporter and the HTTP port; close the connections."""
        for w in self.watchers:
            w.stop()
        if self.http is not None:
            self.http.stop()
        if self.reporter is not None:
            self.reporter.close()
        self.dispatcher.close()


def _spinning_connect(spin_us: float):
    """``connect`` with ``spin_us`` for ``unix:`` / ``cudaipc:`` endpoints (0 on ``unix:``
    blocks at once: no adaptive spin), as ``eaas attention-client --spin-us`` does."""

    def connect(endpoint: str, server_id: str, **kw: Any) -> Any:
        if endpoint.startswith(("unix:", "cudaipc:")):
            kw["spin_us"] = spin_us
            if spin_us == 0 and endpoint.startswith("unix:"):
                kw["max_spin_us"] = 0.0
        return transport_connect(endpoint, server_id, **kw)

    return connect
