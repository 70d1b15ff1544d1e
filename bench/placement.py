"""Placement benchmark: EaaS incremental placement against DeepSeek's EPLB.

EPLB (github.com/deepseek-ai/EPLB, DeepSeek-V3 report arXiv:2412.19437 §3.4) is re-implemented
here from its published description, not copied:

* ``replicate``: every logical expert starts with one replica; the remaining physical slots go,
  one at a time, to the expert with the highest load per replica;
* ``pack``: items sorted by load, each put on the least-loaded pack that still has room (every
  pack gets the same number of items);
* global policy: replicate over the whole layer, pack replicas onto GPUs;
* hierarchical policy (when ``groups % nodes == 0``): pack expert groups onto nodes, then
  replicate and pack within each node.

EPLB needs ``physical slots % GPUs == 0`` (and ``GPUs % nodes == 0`` for hierarchical); EaaS
takes any server count. Both get the same slots (``slots_per_server = physical / GPUs``); EaaS
runs with ``redundancy=1`` for the like-for-like comparison and with ``redundancy=2`` (its
fault-tolerant default) as a second column. Balancedness = sum over layers of mean GPU load /
sum over layers of max GPU load.

Loads: the two-layer example of EPLB's README (12 experts, 16 replicas, 4 groups, 2 nodes, 8
GPUs) and synthetic Zipf-skewed loads (256 experts, a random expert order per layer).

Run: ``.venv/bin/python bench/placement.py`` (``--quick`` for a smaller run).
"""

from __future__ import annotations

import argparse
import heapq
import random
import time
from collections.abc import Iterator, Sequence

from eaas.runtime.placement import (
    balancedness,
    moved_replicas,
    place_experts,
)

#: Expert loads published in the README of github.com/deepseek-ai/EPLB (2 layers x 12 experts).
EPLB_README_LOADS = [
    [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
    [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
]
EPLB_README_SHAPE = {"replicas": 16, "groups": 4, "nodes": 2, "gpus": 8}


# ---------------------------------------------------------------------------------------------
# EPLB reference (from the published description)
# ---------------------------------------------------------------------------------------------
def eplb_replicate(w: Sequence[float], slots: int) -> list[int]:
    """Replica count per expert: 1 each, then the hottest load per replica gets the next."""
    cnt = [1] * len(w)
    heap = [(-w[e], e) for e in range(len(w))]
    heapq.heapify(heap)
    for _ in range(slots - len(w)):
        _, e = heapq.heappop(heap)
        cnt[e] += 1
        heapq.heappush(heap, (-w[e] / cnt[e], e))
    return cnt


def eplb_pack(weights: Sequence[float], packs: int) -> list[int]:
    """Balanced packing: item -> pack, every pack gets len(weights) / packs items."""
    cap = len(weights) // packs
    load = [0.0] * packs
    count = [0] * packs
    out = [0] * len(weights)
    for i in sorted(range(len(weights)), key=lambda i: -weights[i]):
        p = min((p for p in range(packs) if count[p] < cap), key=lambda p: load[p])
        out[i] = p
        load[p] += weights[i]
        count[p] += 1
    return out


def eplb_layout(
    w: Sequence[float], slots: int, gpus: int, groups: int, nodes: int
) -> list[list[tuple[int, float]]]:
    """One layer under EPLB: per GPU, its ``(logical expert, replica load)`` items
    (hierarchical when ``nodes > 1`` and ``groups % nodes == 0``, else global).

    Raises:
        ValueError: ``slots % gpus`` or ``gpus % nodes`` is not 0 (EPLB does not run).
    """
    if slots % gpus or gpus % nodes:
        raise ValueError("EPLB needs slots % gpus == 0 and gpus % nodes == 0")
    if nodes > 1 and groups % nodes == 0 and len(w) % groups == 0:
        size = len(w) // groups
        group_load = [sum(w[g * size : (g + 1) * size]) for g in range(groups)]
        node_of_group = eplb_pack(group_load, nodes)
        parts = [
            [e for e in range(len(w)) if node_of_group[e // size] == node] for node in range(nodes)
        ]
        per_node_gpus, per_node_slots = gpus // nodes, slots // nodes
    else:
        parts = [list(range(len(w)))]
        per_node_gpus, per_node_slots = gpus, slots
    out: list[list[tuple[int, float]]] = []
    for experts in parts:
        cnt = eplb_replicate([w[e] for e in experts], per_node_slots)
        items = [(e, w[e] / c) for e, c in zip(experts, cnt, strict=True) for _ in range(c)]
        packs = eplb_pack([x for _, x in items], per_node_gpus)
        gpu_items: list[list[tuple[int, float]]] = [[] for _ in range(per_node_gpus)]
        for item, pk in zip(items, packs, strict=True):
            gpu_items[pk].append(item)
        out += gpu_items
    return out


def eplb_balancedness(
    loads: Sequence[Sequence[float]], slots: int, gpus: int, groups: int, nodes: int
) -> tuple[float, bool]:
    """(balancedness, whether some GPU got two replicas of one expert, which EaaS forbids)."""
    mean = peak = 0.0
    colocated = False
    for w in loads:
        layout = eplb_layout(w, slots, gpus, groups, nodes)
        g = [sum(x for _, x in items) for items in layout]
        colocated |= any(len({e for e, _ in items}) < len(items) for items in layout)
        mean += sum(g) / len(g)
        peak += max(g)
    return mean / peak, colocated


# ---------------------------------------------------------------------------------------------
# cases
# ---------------------------------------------------------------------------------------------
def zipf_loads(layers: int, experts: int, s: float, seed: int) -> list[list[float]]:
    """Per layer, tokens per expert ~ 1 / rank**s, ranks shuffled per layer, x 10,000."""
    rng = random.Random(seed)
    out = []
    for _ in range(layers):
        ranks = list(range(1, experts + 1))
        rng.shuffle(ranks)
        out.append([10000.0 / r**s for r in ranks])
    return out


def ours(loads: Sequence[Sequence[float]], gpus: int, slots: int, redundancy: int = 1) -> float:
    experts = len(loads[0])
    load = {(layer, e): float(v) for layer, row in enumerate(loads) for e, v in enumerate(row)}
    p = place_experts(
        range(len(loads)),
        experts,
        gpus,
        redundancy,
        "load-balanced",
        load,
        slots_per_server=slots // gpus,
    )
    return balancedness(p, load)


def compare(
    loads: Sequence[Sequence[float]], gpus: int, slots: int, groups: int = 8, nodes: int = 0
) -> tuple[float, float, bool]:
    """(EaaS, best EPLB policy, EPLB co-located replicas) balancedness at redundancy 1 on the
    same slots."""
    ref, colocated = eplb_balancedness(loads, slots, gpus, 1, 1)
    if nodes and gpus % nodes == 0:
        h, hc = eplb_balancedness(loads, slots, gpus, groups, nodes)
        if h > ref:
            ref, colocated = h, hc
    return ours(loads, gpus, slots), ref, colocated


def comparison_cases(quick: bool = False) -> Iterator[tuple[str, list[list[float]], int, int]]:
    """(name, loads, gpus, physical slots) for every case where EPLB runs."""
    yield "EPLB README", [list(map(float, r)) for r in EPLB_README_LOADS], 8, 16
    layers = 4 if quick else 58
    for s in (0.8, 1.2) if quick else (0.6, 0.8, 1.0, 1.2):
        loads = zipf_loads(layers, 256, s, seed=1)
        for gpus, slots in (
            ((8, 288), (32, 288))
            if quick
            else ((8, 288), (16, 288), (32, 288), (40, 320), (64, 320))
        ):
            yield f"Zipf s={s}", loads, gpus, slots


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    from tqdm import tqdm

    print("## Balancedness (mean/max GPU load; same physical slots)\n")
    print(
        "| loads | GPUs | slots | EPLB global | EPLB hierarchical | EaaS R=1 | EaaS / best EPLB |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, loads, gpus, slots in tqdm(list(comparison_cases(args.quick)), desc="balance"):
        readme = name == "EPLB README"
        groups, nodes = (4, 2) if readme else (8, max(1, gpus // 8))
        g, gc = eplb_balancedness(loads, slots, gpus, 1, 1)
        h, hc = eplb_balancedness(loads, slots, gpus, groups, nodes)
        o1 = ours(loads, gpus, slots, 1)
        best = max(g, h)
        note = " (EPLB puts 2 replicas of one expert on one GPU)" if (gc if g >= h else hc) else ""
        print(
            f"| {name} | {gpus} | {slots} | {g:.4f} | {h:.4f} | {o1:.4f} | {o1 / best:.3f}x{note} |"
        )
    print(
        "\nWith redundancy 2 (EaaS's default; every expert on 2 distinct servers), slots >= 2E:\n"
    )
    print("| loads | GPUs | slots | EPLB global (no redundancy rule) | EaaS R=2 | ratio |")
    print("|---|---|---|---|---|---|")
    for name, loads, gpus, slots in comparison_cases(args.quick):
        slots2 = gpus * -(-max(slots, 2 * len(loads[0]) + gpus) // gpus)
        g, _ = eplb_balancedness(loads, slots2, gpus, 1, 1)
        o2 = ours(loads, gpus, slots2, 2)
        print(f"| {name} | {gpus} | {slots2} | {g:.4f} | {o2:.4f} | {o2 / g:.3f}x |")
    # non-divisor counts: EPLB does not run, EaaS does
    loads = zipf_loads(4 if args.quick else 58, 256, 1.0, seed=1)
    print("\nEPLB cannot run (slots % GPUs != 0); EaaS (R=2, automatic budget), Zipf s=1.0:\n")
    print("| GPUs | slots/GPU | EaaS R=2 balancedness |")
    print("|---|---|---|")
    for gpus in (41, 60, 100):
        load = {(l, e): v for l, row in enumerate(loads) for e, v in enumerate(row)}
        p = place_experts(
            range(len(loads)), 256, gpus, 2, "load-balanced", load, slots_per_server=0
        )
        print(f"| {gpus} | {p.slots_per_server} | {balancedness(p, load):.4f} |")

    print("\n## Replicas moved per rescale (DeepSeek-V3: 58 MoE layers x 256 experts, R=2)\n")
    print(
        "| rescale | budget | replicas moved | share of new total | survivors changed | wall / CPU (s) |"
    )
    print("|---|---|---|---|---|---|")
    layers = range(3, 61)
    for slots in (0, None):
        for a, b in tqdm(
            [(4, 5), (8, 9), (40, 41), (41, 40), (40, 64), (64, 40), (1024, 64)], desc="rescale"
        ):
            p = place_experts(layers, 256, a, 2, slots_per_server=slots)
            t, c = time.perf_counter(), time.process_time()
            q = place_experts(layers, 256, b, 2, previous=p, slots_per_server=slots)
            dt, dc = time.perf_counter() - t, time.process_time() - c
            m = moved_replicas(p, q)
            changed = sum(1 for s in range(min(a, b)) if set(p.servers[s]) != set(q.servers[s]))
            total = sum(q.experts_per_server())
            label = "auto" if slots == 0 else "none (exactly R)"
            print(
                f"| {a} -> {b} | {label} | {m} | {m / total:.3f} (1/N: {abs(b - a) / max(a, b):.3f}) | {changed}/{min(a, b)} | {dt:.2f} / {dc:.2f} |"
            )

    print("\n## Placement time from scratch (DeepSeek-V3 shape, R=2, automatic budget)\n")
    for n in (40, 256, 1024):
        t, c = time.perf_counter(), time.process_time()
        place_experts(layers, 256, n, 2, slots_per_server=0)
        dt, dc = time.perf_counter() - t, time.process_time() - c
        print(f"- {n} servers: {dt:.2f} s wall, {dc:.2f} CPU-s")


if __name__ == "__main__":
    main()
