"""When a pool's daemon runs a full reconcile step (an idle operator with one 1024-server pool
must cost well under 1% of a core).

A full step of a large pool is expensive (measured with ``bench/operator_idle.py``, 1024 servers:
LIST of the pods and its JSON decode ~37%, the desired pod manifests ~26%, the next routing table
~17% of ~0.5 CPU-s per step), and an idle pool changes nothing between steps. Everything that
can change a pool's outcome wakes its daemon through a watch (its spec, its server pods, nodes,
failure reports, the clients' acknowledgements), so the periodic resync is only a safety net,
as in client-go's informer resync or controller-runtime's ``SyncPeriod``: a step runs

* at once when the daemon was woken (an event), or when the previous step failed (retry after
  ``resync_s``), or while the pool has servers under suspicion (they are re-probed every few
  seconds to bring them back), a routing table staged on its servers, or placement or
  autoscaling that follows the measured load;
* otherwise once per ``idle_resync_s`` (env ``EAAS_OPERATOR_IDLE_RESYNC_S``, default 120 s; 0:
  every ``resync_s`` as before), and then only when something the step reads changed since the
  last step began (the pods' resourceVersions in the watch's index, node readiness and labels,
  the table, the clients' acknowledgements, the measured load, failure reports:
  :meth:`eaas.operator.state.OperatorState.step_inputs`; an unchanged idle step of a
  4,096-server pool cost ~1 CPU-s), and at least every
  :data:`~eaas.operator.state.LIST_RESYNC_S` (that step LISTs the pods, the safety net of a
  watch that missed an event; an HPA or NetworkPolicy removed by hand is re-applied by it).
  ``status.load`` of a pool that is not load-driven is therefore refreshed only this often.
"""

from __future__ import annotations


def step_due(
    woken: bool, failed: bool, busy: bool, since_last_step_s: float, idle_resync_s: float
) -> bool:
    """Whether the daemon runs a full step now (it is called every ``resync_s``).

    Args:
        woken: an event woke the daemon since the last step (or this is the first one).
        failed: the last step raised (an API error): retry.
        busy: the object needs periodic steps (a pool with suspected servers, a staged table
            or load-driven placement/autoscaling: :meth:`eaas.operator.state.PoolMemory.busy`).
        since_last_step_s: seconds since the last full step began.
        idle_resync_s: period of steps when nothing happens (0: every call).
    """
    return woken or failed or busy or since_last_step_s >= idle_resync_s
