"""What a rescale costs in running servers: ``placement.assignment: command-line`` (experts on
each pod's command line) against ``routing-table`` (experts from the pushed table), on the DeepSeek-V3 shape (58 MoE layers x 256 experts, redundancy 2).

For each rescale ``N -> N'`` it runs the operator's own pure code on both sides:

* survivors restarted: surviving pods whose desired manifest's ``eaas.io/spec-hash`` differs
  from the one they were created with (the operator replaces such a pod);
* replicas moved: replicas the surviving and new servers must load (weights moved);
* the placement time (CPU seconds) of the step.

``command-line`` uses :func:`eaas.operator.pool_placement.compute_placement` from the pods'
experts (today's path); ``routing-table`` uses :func:`member_placement` from the published
table, with no survivor pod changing.

Run: ``.venv/bin/python bench/live_rescale.py`` (``--quick``: 4->5, 5->4 only).
"""

from __future__ import annotations

import argparse
import time

from eaas.operator.crd import ANNOTATION_SPEC_HASH, ExpertPoolSpec
from eaas.operator.names import Owner, server_name
from eaas.operator.pods import ObservedPod, desired_server_pods, desired_table_pods
from eaas.operator.pool_placement import compute_placement, member_placement, placement_revision
from eaas.operator.table import assignment_of, table_from_assignment

OWNER = Owner(kind="ExpertPool", name="dsv3", namespace="bench", uid="u", generation=1)


def spec(replicas: int, assignment: str) -> ExpertPoolSpec:
    return ExpertPoolSpec.model_validate(
        {
            "model": {"uri": "/m", "firstMoeLayer": 3, "numMoeLayers": 58, "numExperts": 256},
            "replicas": replicas,
            "redundancy": 2,
            "placement": {"assignment": assignment},
        }
    )


def command_line(n: int, m: int) -> tuple[int, int, float]:
    s_n = spec(n, "command-line")
    place_n = compute_placement(s_n)
    pods_n = desired_server_pods(OWNER, s_n, place_n, placement_revision(s_n))
    observed = [
        ObservedPod(
            name=name,
            index=i,
            spec_hash=pods_n[name]["metadata"]["annotations"][ANNOTATION_SPEC_HASH],
            experts=place_n.servers[i],
            ready=True,
            ip="10.0.0.1",
            phase="Running",
        )
        for i, name in enumerate(pods_n)
    ]
    s_m = spec(m, "command-line")
    t0 = time.process_time()
    place_m = compute_placement(s_m, None, observed)
    cpu = time.process_time() - t0
    pods_m = desired_server_pods(OWNER, s_m, place_m, placement_revision(s_m))
    restarted = sum(
        1
        for i in range(min(n, m))
        if pods_m[server_name(OWNER.name, i)]["metadata"]["annotations"][ANNOTATION_SPEC_HASH]
        != observed[i].spec_hash
    )
    moved = sum(
        len(set(place_m.servers[i]) - set(place_n.servers[i] if i < n else ())) for i in range(m)
    )
    return restarted, moved, cpu


def routing_table(n: int, m: int) -> tuple[int, int, float]:
    s_n = spec(n, "routing-table")
    names = [server_name(OWNER.name, i) for i in range(max(n, m))]
    eps = {x: f"tcp://10.0.{i // 250}.{i % 250}:9000" for i, x in enumerate(names)}
    a_n = member_placement(s_n, names[:n], None)
    t_n = table_from_assignment(s_n, a_n, {x: eps[x] for x in names[:n]}, 1)
    hashes_n = {
        k: v["metadata"]["annotations"][ANNOTATION_SPEC_HASH]
        for k, v in desired_table_pods(OWNER, s_n, placement_revision(s_n)).items()
    }
    s_m = spec(m, "routing-table")
    t0 = time.process_time()
    a_m = member_placement(s_m, names[:m], t_n)
    cpu = time.process_time() - t0
    hashes_m = {
        k: v["metadata"]["annotations"][ANNOTATION_SPEC_HASH]
        for k, v in desired_table_pods(OWNER, s_m, placement_revision(s_m)).items()
    }
    restarted = sum(1 for k in names[: min(n, m)] if hashes_m[k] != hashes_n[k])
    held = assignment_of(t_n)
    moved = sum(len(set(a_m[x]) - held.get(x, frozenset())) for x in names[:m])
    return restarted, moved, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    steps = [(4, 5), (5, 4)] if args.quick else [(4, 5), (5, 4), (40, 41), (41, 40), (64, 40)]
    total = 58 * 256 * 2
    print(f"DeepSeek-V3 shape, redundancy 2 ({total} replicas at minimum)")
    print(f"{'rescale':>9} | {'assignment':>13} | survivors restarted | replicas moved | CPU s")
    for n, m in steps:
        for mode, fn in (("command-line", command_line), ("routing-table", routing_table)):
            restarted, moved, cpu = fn(n, m)
            print(
                f"{n:>4}->{m:<4} | {mode:>13} | {restarted:>8}/{min(n, m):<10} | "
                f"{moved:>14} | {cpu:.2f}"
            )


if __name__ == "__main__":
    main()
