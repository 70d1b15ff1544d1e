"""One operator per cluster, pure logic: of the operator Leases in every namespace, the holder of
the oldest live one acts; a Lease whose resourceVersion stops changing for the lease duration
(own clock) is dead and the next oldest takes over."""

from __future__ import annotations

import pytest

from eaas.operator.cluster_lease import LeaseView, LiveLeases, cluster_winner

pytestmark = pytest.mark.failstatic


def view(ns: str, created: str, rv: str, holder: str = "h") -> LeaseView:
    return LeaseView(ns, "eaas-operator", holder and f"{holder}-{ns}", created, rv, f"http://{ns}")


def test_oldest_live_lease_acts_whatever_the_namespace():
    helm = view("eaas-system", "2026-01-01T00:00:05Z", "1")
    local = view("default", "2026-01-01T00:00:09Z", "7")
    assert cluster_winner([local, helm]) == helm
    assert cluster_winner([]) is None
    # equal creation second: the namespace decides, the same on every operator
    tie = view("a", "2026-01-01T00:00:05Z", "3")
    assert cluster_winner([helm, tie]) == tie


def test_a_lease_that_stops_changing_dies_after_the_lease_duration():
    live = LiveLeases(lease_duration_s=15)
    a = view("a", "2026-01-01T00:00:01Z", "1")
    b = view("b", "2026-01-01T00:00:02Z", "1")
    assert live.observe([a, b], now=100.0) == [a, b]  # first seen: live
    b2 = view("b", b.created, "2")
    assert live.observe([a, b2], now=114.9) == [a, b2]
    assert live.observe([a, view("b", b.created, "3")], now=115.0) == [view("b", b.created, "3")]
    assert cluster_winner(live.observe([a, view("b", b.created, "4")], now=116.0)).namespace == "b"
    # its holder's successor renews it again: live again, and the older one acts again
    a2 = view("a", a.created, "9")
    assert cluster_winner(live.observe([a2, view("b", b.created, "5")], now=117.0)) == a2


def test_a_free_or_deleted_lease_never_acts():
    live = LiveLeases(lease_duration_s=15)
    free = view("a", "2026-01-01T00:00:01Z", "1", holder="")
    b = view("b", "2026-01-01T00:00:02Z", "1")
    assert live.observe([free, b], now=0.0) == [b]
    assert live.observe([b], now=1.0) == [b]  # a's Lease deleted: forgotten
