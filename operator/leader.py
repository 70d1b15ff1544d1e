"""Exactly one operator acts: leader election on a ``coordination.k8s.io/v1`` Lease.

Several ``eaas operator`` processes (Helm's two replicas, or a second one started by mistake)
may run; only the holder of the Lease ``eaas-operator`` reconciles, pushes tables, posts Events
and acts on failure reports. The others watch and wait. This is client-go's leader election
(``k8s.io/client-go/tools/leaderelection``) in miniature:

* the leader renews the Lease (``spec.renewTime``) every ``retry_s``; it stops acting when its
  last successful renewal is older than ``renew_deadline_s`` (< ``lease_duration_s``), so it has
  given up before anyone else may take over;
* a candidate takes the Lease only when it has seen the same Lease record (resourceVersion)
  for ``lease_duration_s`` of its own clock, or when the Lease is free (no holder: a leader that
  shut down gracefully releases it, so a restart is quick);
* every write carries the resourceVersion it read (optimistic concurrency): of two candidates
  one wins, the other gets 409 and stays a candidate.

The leader advertises where it takes failure reports (annotation ``eaas.io/leader-url`` on the
Lease, :attr:`LeaseSettings.advertise_url`); a standby that gets a report forwards it there
(:attr:`LeaderElector.leader_url`), so a Service in front of all replicas works. On shutdown a
leader deletes the Lease (precondition: the resourceVersion it holds) instead of only freeing
it: a successor creates it again at once. With :attr:`LeaseSettings.owner_deployment` (the
Helm chart sets its own Deployment) the Lease carries an ownerReference to that Deployment, so
the garbage collector deletes it with the release even when no replica got to clean up
(``helm uninstall`` deletes the RBAC that the last replica's delete would need).

Across namespaces (an ``eaas operator`` in ``default`` and a Helm release in ``eaas-system``
each hold their own Lease), only the holder of the oldest live operator Lease of the cluster
acts (:mod:`eaas.operator.cluster_lease`); the other holders stand by and say for whom.

kopf's own peering is not used: operators of equal priority all freeze under it (kopf docs,
"Peering"), which is no failover.

The decision (:func:`lease_decision`) is pure; :class:`LeaderElector` does the I/O in a thread.
"""

from __future__ import annotations

import datetime as _dt
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Literal

from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from eaas.operator.cluster_lease import (
    LABEL_OPERATOR_LEASE,
    LeaseView,
    LiveLeases,
    cluster_winner,
)
from eaas.operator.settings import LeaseSettings

log = logging.getLogger("eaas.operator.leader")

#: Lease annotation: the holder's failure-report base URL (``http://IP:PORT``).
ANNOTATION_LEADER_URL = "eaas.io/leader-url"

Decision = Literal["renew", "acquire", "wait"]


def lease_decision(
    holder: str, me: str, unchanged_for_s: float, lease_duration_s: float
) -> Decision:
    """What a candidate does with the Lease it just read.

    Args:
        holder: ``spec.holderIdentity`` ("" when free).
        me: this candidate's identity.
        unchanged_for_s: for how long (own monotonic clock) the Lease's resourceVersion has not
            changed since this candidate first saw it.
        lease_duration_s: the election's lease duration.

    Returns:
        ``renew`` (it is ours), ``acquire`` (free, or its holder stopped renewing), or ``wait``.
    """
    if holder == me:
        return "renew"
    if not holder or unchanged_for_s >= lease_duration_s:
        return "acquire"
    return "wait"


def lease_spec(
    settings: LeaseSettings, holder: str, transitions: int, acquired: _dt.datetime | None
) -> dict[str, Any]:
    """Keyword arguments of the ``V1LeaseSpec`` this candidate writes (``acquired``: the
    acquireTime to keep when renewing, or None to set it now)."""
    now = _dt.datetime.now(_dt.timezone.utc)
    return {
        "holder_identity": holder,
        "lease_duration_seconds": max(1, round(settings.lease_duration_s)),
        "acquire_time": acquired or now,
        "renew_time": now,
        "lease_transitions": transitions,
    }


class LeaderElector:
    """Runs the election in a daemon thread; :meth:`is_leader` is what the operator checks.

    Args:
        settings: the election.
        api: a kubernetes ``ApiClient``.
        on_change: called (from the election thread) with True/False when leadership flips.
    """

    def __init__(
        self,
        settings: LeaseSettings,
        api: Any,
        on_change: Callable[[bool], None] | None = None,
    ) -> None:
        self.settings = settings
        self.coord = k8s.CoordinationV1Api(api)
        self.on_change = on_change
        self._renewed_at = -1e18  # monotonic time of the last successful write as holder
        self._seen_rv = ""
        self._seen_at = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._was_leader = False
        self._leader_url = ""
        self._owner_refs: list[Any] | None = None
        self._live = LiveLeases(settings.lease_duration_s)
        self._cluster_ok_at = -1e18  # monotonic time this Lease was last the cluster's oldest
        self._acting: LeaseView | None = None  # another namespace's Lease that acts instead
        self._held_since = 0.0  # monotonic time this process last acquired its Lease

    def is_leader(self) -> bool:
        """True while this process holds the Lease, renewed it within the renew deadline, and
        its Lease was then the oldest live operator Lease of the cluster."""
        now = time.monotonic()
        deadline = self.settings.renew_deadline_s
        return now - self._renewed_at < deadline and now - self._cluster_ok_at < deadline

    @property
    def leader_url(self) -> str:
        """The acting operator's advertised report URL as last read ("" when unknown or when
        this process acts): this namespace's holder, or the other namespace's operator this
        one stands by for."""
        if self.is_leader():
            return ""
        if self._acting is not None and self._renewed_at > -1e18:
            return self._acting.url
        return self._leader_url

    def start(self) -> LeaderElector:
        self._thread = threading.Thread(target=self._run, name="eaas-leader", daemon=True)
        self._thread.start()
        return self

    def stop(self, release: bool = True) -> None:
        """Stop campaigning; with ``release``, delete the Lease if held (a successor creates it
        at once instead of waiting out the lease duration, and nothing is left behind)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if release and self.is_leader():
            try:
                lease = self.coord.read_namespaced_lease(
                    self.settings.name, self.settings.namespace
                )
                if lease.spec is not None and lease.spec.holder_identity == self.settings.identity:
                    self.coord.delete_namespaced_lease(
                        self.settings.name,
                        self.settings.namespace,
                        body=k8s.V1DeleteOptions(
                            preconditions=k8s.V1Preconditions(
                                resource_version=(
                                    lease.metadata or k8s.V1ObjectMeta()
                                ).resource_version
                            )
                        ),
                    )
                    log.info("released Lease %s (deleted)", self.settings.name)
            except Exception as exc:  # best effort: the successor waits the lease out instead
                log.warning("could not release Lease %s: %s", self.settings.name, exc)
        self._renewed_at = -1e18
        self._flip()

    def _flip(self) -> None:
        now = self.is_leader()
        if now != self._was_leader:
            self._was_leader = now
            log.info(
                "%s leadership (Lease %s/%s, identity %s)",
                "acquired" if now else "lost",
                self.settings.namespace,
                self.settings.name,
                self.settings.identity,
            )
            if self.on_change is not None:
                self.on_change(now)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except Exception as exc:  # API down: keep trying; is_leader() expires by itself
                log.warning("leader election step failed: %s", exc)
            self._flip()
            self._stop.wait(self.settings.retry_s)

    def _owners(self) -> list[Any] | None:
        """ownerReferences for the Lease (the owning Deployment, read once), or None."""
        s = self.settings
        if not s.owner_deployment:
            return None
        if self._owner_refs is None:
            dep = k8s.AppsV1Api(self.coord.api_client).read_namespaced_deployment(
                s.owner_deployment, s.namespace
            )
            uid = dep.metadata.uid if dep.metadata is not None else None
            if not uid:
                raise RuntimeError(f"Deployment {s.owner_deployment} has no uid")
            self._owner_refs = [
                k8s.V1OwnerReference(
                    api_version="apps/v1",
                    kind="Deployment",
                    name=s.owner_deployment,
                    uid=str(uid),
                )
            ]
        return self._owner_refs

    def step(self) -> Decision:
        """Read the Lease, decide, write if needed. Returns the decision taken."""
        s = self.settings
        started = time.monotonic()
        try:
            lease = self.coord.read_namespaced_lease(s.name, s.namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise
            body = k8s.V1Lease(
                metadata=k8s.V1ObjectMeta(
                    name=s.name,
                    namespace=s.namespace,
                    annotations={ANNOTATION_LEADER_URL: s.advertise_url},
                    labels={LABEL_OPERATOR_LEASE: "true"},
                    owner_references=self._owners(),
                ),
                spec=k8s.V1LeaseSpec(**lease_spec(s, s.identity, 0, None)),
            )
            try:
                self.coord.create_namespaced_lease(s.namespace, body)
            except ApiException as exc2:
                if exc2.status == 409:
                    return "wait"
                raise
            self._renewed_at = self._held_since = started
            self._check_cluster(started)
            return "acquire"
        now = time.monotonic()
        rv = (lease.metadata.resource_version if lease.metadata else None) or ""
        if rv != self._seen_rv:
            self._seen_rv, self._seen_at = rv, now
        spec = lease.spec or k8s.V1LeaseSpec()
        holder = spec.holder_identity or ""
        annotations = (lease.metadata.annotations if lease.metadata else None) or {}
        self._leader_url = annotations.get(ANNOTATION_LEADER_URL, "") if holder else ""
        decision = lease_decision(holder, s.identity, now - self._seen_at, s.lease_duration_s)
        if decision == "wait":
            return decision
        transitions = int(spec.lease_transitions or 0) + (decision == "acquire")
        keep = spec.acquire_time if decision == "renew" else None
        lease.spec = k8s.V1LeaseSpec(**lease_spec(s, s.identity, transitions, keep))
        if lease.metadata is not None:
            lease.metadata.annotations = {**annotations, ANNOTATION_LEADER_URL: s.advertise_url}
            lease.metadata.labels = {**(lease.metadata.labels or {}), LABEL_OPERATOR_LEASE: "true"}
            if self.settings.owner_deployment and not lease.metadata.owner_references:
                lease.metadata.owner_references = self._owners()
        try:
            self.coord.replace_namespaced_lease(s.name, s.namespace, lease)  # carries rv
        except ApiException as exc:
            if exc.status == 409:  # someone else wrote first
                return "wait"
            raise
        self._renewed_at = started  # conservative: before the read
        if decision == "acquire":
            self._held_since = started
        self._check_cluster(started)
        return decision

    def _check_cluster(self, started: float) -> None:
        """After holding this namespace's Lease: act only if it is the oldest live operator
        Lease of the cluster (:func:`cluster_winner`); else stand by, naming the one that acts.
        A failed list (e.g. RBAC) leaves this process standing by until one succeeds."""
        s = self.settings
        try:
            listed = self.coord.list_lease_for_all_namespaces(
                label_selector=f"{LABEL_OPERATOR_LEASE}=true"
            )
        except ApiException as exc:
            log.error(
                "standing by: cannot list operator Leases in all namespaces (%s %s); an "
                "operator needs get/list on coordination.k8s.io leases cluster-wide to know "
                "it is the only one acting",
                exc.status,
                exc.reason,
            )
            return
        views = [_view(item) for item in listed.items or []]
        live = self._live.observe(views, time.monotonic())
        if not any(v.key == (s.namespace, s.name) for v in live):
            # just written, not listed yet: the youngest
            live.append(LeaseView(s.namespace, s.name, s.identity, "\uffff", ""))
        winner = cluster_winner(live)
        if winner is None or winner.key == (s.namespace, s.name):
            if len(live) > 1 and started - self._held_since < 1.5 * s.retry_s:
                # just acquired while another operator's Lease is live: let a holder that took
                # over meanwhile see this Lease live again (it checks every retry_s) first
                return
            if self._acting is not None:
                log.info("no older operator Lease is live any more: this operator acts")
            self._acting = None
            self._cluster_ok_at = started
            return
        if self._acting is None or self._acting.key != winner.key:
            log.warning(
                "standing by: operator %s (Lease %s/%s) acts for this cluster; this one "
                "(Lease %s/%s, identity %s) waits until it stops",
                winner.holder,
                winner.namespace,
                winner.name,
                s.namespace,
                s.name,
                s.identity,
            )
        self._acting = winner
        self._cluster_ok_at = -1e18


def _view(lease: Any) -> LeaseView:
    """A listed ``V1Lease`` as a :class:`LeaseView`."""
    meta = lease.metadata or k8s.V1ObjectMeta()
    created = meta.creation_timestamp
    if isinstance(created, _dt.datetime):
        created = created.astimezone(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return LeaseView(
        namespace=meta.namespace or "",
        name=meta.name or "",
        holder=(lease.spec.holder_identity if lease.spec is not None else None) or "",
        created=str(created or ""),
        resource_version=meta.resource_version or "",
        url=(meta.annotations or {}).get(ANNOTATION_LEADER_URL, ""),
    )
