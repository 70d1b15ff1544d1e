"""CPU pinning of the expert servers of ``eaas serve``: their scheduling policies and one CPU
per server chosen so the servers of one decode call run on different CPUs."""

from __future__ import annotations

import os
from collections.abc import Sequence

from .core import Placement
from .metrics import dispatch_columns

#: expert servers' Linux scheduling policies (``sched(7)``; neither needs privileges):
#: ``eaas expert-server --sched-policy`` and ``eaas serve --server-sched-policy``
SCHED_POLICIES = {"other": os.SCHED_OTHER, "batch": os.SCHED_BATCH}


def spread_over_cpus(placement: Placement, cpus: Sequence[int]) -> tuple[int, ...]:
    """One CPU per server (``eaas serve --server-cpus auto``) such that the servers one decode
    call reaches (:func:`dispatch_columns`) run on different CPUs where the CPUs allow it.

    Why: a call wakes its servers together and waits for the slowest. Unpinned on a 2-core
    host, the kernel often queued both servers of a call on one CPU (the second waited ~1.2 ms,
    a whole frame) while the other CPU went idle: its idle balancing skips a CPU whose idle
    spells are short (``docs/serving.md``, "The price of disaggregation, fourth pass").

    Servers spread evenly (counts differ by at most one); then, greedy in server order, each
    goes to the CPU (with room) holding the fewest servers it shares a column with; then swaps of
    two servers' CPUs while one lowers the number of same-CPU pairs in a column. Deterministic.

    Args:
        placement: the placement the routing table is built from.
        cpus: CPU ids to use (e.g. ``sorted(os.sched_getaffinity(0))``), at least one.

    Returns:
        ``cpu[s]`` for every server ``s`` (a value of ``cpus``).

    Raises:
        ValueError: ``cpus`` is empty.
    """
    if not cpus:
        raise ValueError("no CPUs to spread the servers over")
    n, m = placement.num_servers, len(cpus)
    shared = [[0] * n for _ in range(n)]  # shared[s][t]: columns holding both s and t
    for col in dispatch_columns(placement):
        for s in col:
            for t in col:
                if s != t:
                    shared[s][t] += 1
    room = -(-n // m)  # at most this many servers per CPU
    on: list[list[int]] = [[] for _ in range(m)]  # servers on each CPU (by position)
    where = [0] * n
    for s in range(n):
        best = min(
            (c for c in range(m) if len(on[c]) < room),
            key=lambda c: (sum(shared[s][t] for t in on[c]), len(on[c]), c),
        )
        on[best].append(s)
        where[s] = best

    def cost(s: int, c: int, skip: int) -> int:  # s's column mates on CPU c, ``skip`` aside
        return sum(shared[s][t] for t in on[c] if t != skip)

    improved = True
    while improved:  # each swap lowers the total: it ends
        improved = False
        for s in range(n):
            for t in range(s + 1, n):
                a, b = where[s], where[t]
                if a == b:
                    continue
                delta = cost(s, b, t) + cost(t, a, s) - cost(s, a, s) - cost(t, b, t)
                if delta < 0:
                    on[a].remove(s)
                    on[b].remove(t)
                    on[a].append(t)
                    on[b].append(s)
                    where[s], where[t] = b, a
                    improved = True
    return tuple(int(cpus[where[s]]) for s in range(n))
