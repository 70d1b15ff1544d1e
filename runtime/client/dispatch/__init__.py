"""Dispatch and combine: the attention client's side of one MoE layer call.

The package, by concern:

* :mod:`.policy`: the replica policy, pure (no sockets): :class:`ReplicaMap` (a routing table
  as tensors), :func:`choose_replicas`, :func:`live_replicas`, :class:`PhaseTables`,
  :func:`reconnect_delay`, :func:`uncovered_experts`.
* :mod:`.connections`: per-server connection state, connect and reconnect with back-off on a
  connector thread, mark down.
* :mod:`.frames`: a layer call's tensors checked once (:func:`check_call`) and one frame per
  server.
* :mod:`.staging`: where a call's hidden states live (host or GPU) for each connection.
* :mod:`.dispatcher`: :class:`Dispatcher` (one per attention client process: the routing
  table in use, the replica plan of each layer call, ``/health``).
* :mod:`.call`: :class:`PendingDispatch`, one layer call in flight (its rounds of frames,
  failover, combine).

The model's MoE block reaches the dispatcher through :mod:`eaas.runtime.client.moe`.
"""

from eaas.runtime.client.dispatch.call import PendingDispatch
from eaas.runtime.client.dispatch.connections import Connector
from eaas.runtime.client.dispatch.dispatcher import (
    HEALTH_MAX_UNCOVERED,
    Dispatcher,
    NoLiveReplicaError,
)
from eaas.runtime.client.dispatch.frames import check_call
from eaas.runtime.client.dispatch.policy import (
    DEFAULT_SPLIT_PAIRS,
    FIRST_CONNECT_RETRY_S,
    MAX_PHASES,
    NO_REPLICA,
    NO_SERVER,
    PhaseTables,
    ReplicaMap,
    choose_replicas,
    live_replicas,
    reconnect_delay,
    uncovered_experts,
)

__all__ = [
    "DEFAULT_SPLIT_PAIRS",
    "FIRST_CONNECT_RETRY_S",
    "HEALTH_MAX_UNCOVERED",
    "MAX_PHASES",
    "NO_REPLICA",
    "NO_SERVER",
    "Connector",
    "Dispatcher",
    "NoLiveReplicaError",
    "PendingDispatch",
    "PhaseTables",
    "ReplicaMap",
    "check_call",
    "choose_replicas",
    "live_replicas",
    "reconnect_delay",
    "uncovered_experts",
]
