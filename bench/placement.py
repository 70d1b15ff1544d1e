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

Rescale under a movement budget (``--rescale``): Zipf(1.0), Zipf(1.5) and log-normal loads over
256 experts x 58 MoE layers, R=2, slot budget ``ceil(1.25 * E * R / N_before)`` per server (25%
extra replicas); every rescale of 32->33, 40->41, 41->40, 64->40, 64->65 and a load shift at 40
servers (every expert's load times a log-normal factor, sigma 0.5; rebalance) plus a stress row
(the hot set re-drawn: a new random expert order). Columns: balancedness and moved replicas
(share of the new total) of the load-oblivious step, of the default budget
(``max_moved_fraction`` 0.1) and of no limit, beside from-scratch placements (EaaS; EPLB's
global policy on the same slots, without the redundancy rule). Writes
``docs/bench-placement.png`` with ``--png``; then the CPU time of one placement at 1024 servers
x 58 layers x 256 experts (from scratch, +-1 server, a load shift).

Run: ``.venv/bin/python bench/placement.py`` (``--quick`` for a smaller run; ``--rescale`` for
the rescale table only).
"""

from __future__ import annotations

import argparse
import heapq
import random
import time
from collections.abc import Iterator, Sequence

from eaas.runtime.placement import (
    DEFAULT_MAX_MOVED_FRACTION,
    Placement,
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


def lognormal_loads(layers: int, experts: int, sigma: float, seed: int) -> list[list[float]]:
    """Per layer, tokens per expert ~ 1000 * LogNormal(0, sigma)."""
    rng = random.Random(seed)
    return [
        [1000.0 * rng.lognormvariate(0.0, sigma) for _ in range(experts)] for _ in range(layers)
    ]


def as_load(loads: Sequence[Sequence[float]]) -> dict[tuple[int, int], float]:
    return {(layer, e): float(v) for layer, row in enumerate(loads) for e, v in enumerate(row)}


RESCALES = ((32, 33), (40, 41), (41, 40), (64, 40), (64, 65), (40, "shift"), (40, "re-drawn"))


def rescale_rows(quick: bool = False) -> Iterator[dict]:
    """One dict per (load, rescale): balancedness ``b_*`` and moved share ``m_*`` of the
    load-oblivious step (``oblivious``), the default budget (``default``), no limit
    (``unlimited``), and from-scratch ``b_scratch`` (EaaS) / ``b_eplb`` (EPLB global)."""
    layers, experts, r = (6 if quick else 58), 256, 2
    families = {
        "Zipf(1.0)": lambda seed: zipf_loads(layers, experts, 1.0, seed),
        "Zipf(1.5)": lambda seed: zipf_loads(layers, experts, 1.5, seed),
        "log-normal": lambda seed: lognormal_loads(layers, experts, 1.0, seed),
    }
    for name, make in families.items():
        base = make(1)
        for old, new in RESCALES[:3] if quick else RESCALES:
            slots = -(-5 * experts * r // (4 * old))  # ceil(1.25 * E * R / old)
            load = as_load(base)
            p = place_experts(range(layers), experts, old, r, "load-balanced", load,
                              slots_per_server=slots)  # fmt: skip
            n, rebalance = (new, False) if isinstance(new, int) else (old, True)
            if new == "shift":
                rng = random.Random(5)
                load = {k: v * rng.lognormvariate(0.0, 0.5) for k, v in load.items()}
            elif new == "re-drawn":
                load = as_load(make(2))
            row: dict = {"load": name, "rescale": f"{old} -> {new}", "slots": slots}
            obl = place_experts(range(layers), experts, n, r, previous=p, slots_per_server=slots)
            for key, q in (
                ("oblivious", obl),
                *(
                    (
                        key,
                        place_experts(
                            range(layers),
                            experts,
                            n,
                            r,
                            "load-balanced",
                            load,
                            previous=p,
                            slots_per_server=slots,
                            rebalance=rebalance,
                            max_moved_fraction=f,
                        ),
                    )  # fmt: skip
                    for key, f in (("default", DEFAULT_MAX_MOVED_FRACTION), ("unlimited", None))
                ),
            ):
                total = sum(q.experts_per_server())
                row[f"b_{key}"] = balancedness(q, load)
                row[f"m_{key}"] = moved_replicas(p, q) / total
            fresh = place_experts(range(layers), experts, n, r, "load-balanced", load,
                                  slots_per_server=slots)  # fmt: skip
            row["b_scratch"] = balancedness(fresh, load)
            rows_by_layer = [[load[(lay, e)] for e in range(experts)] for lay in range(layers)]
            row["b_eplb"], _ = eplb_balancedness(rows_by_layer, fresh.slots_per_server * n, n, 1, 1)
            yield row


def rescale_table(rows: list[dict]) -> str:
    """The markdown table of :func:`rescale_rows`."""
    out = [
        "| load | rescale | slots/server | load-oblivious step | default budget (0.1) | "
        "no limit | from scratch (EaaS) | from scratch (EPLB global) | default / scratch | "
        "no limit / scratch |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for x in rows:
        cells = [
            f"{x[f'b_{k}']:.4f} (moved {x[f'm_{k}']:.3f})"
            for k in ("oblivious", "default", "unlimited")
        ]
        out.append(
            f"| {x['load']} | {x['rescale']} | {x['slots']} | {' | '.join(cells)} | "
            f"{x['b_scratch']:.4f} | {x['b_eplb']:.4f} | {x['b_default'] / x['b_scratch']:.3f}x | "
            f"{x['b_unlimited'] / x['b_scratch']:.3f}x |"
        )
    return "\n".join(out)


def speed_table() -> str:
    """CPU seconds of one placement at 1024 servers x 58 layers x 256 experts (R=2, automatic
    budget, Zipf(1.0) load): from scratch, one server added, one removed, a load shift."""
    layers = range(58)
    load = as_load(zipf_loads(58, 256, 1.0, seed=1))
    rng = random.Random(5)
    shifted = {k: v * rng.lognormvariate(0.0, 0.5) for k, v in load.items()}
    out = ["| placement | CPU s | wall s |", "|---|---|---|"]

    def timed(label: str, **kw) -> Placement:
        t, c = time.perf_counter(), time.process_time()
        p = place_experts(layers, 256, policy="load-balanced", redundancy=2,
                          slots_per_server=0, **kw)  # fmt: skip
        out.append(f"| {label} | {time.process_time() - c:.2f} | {time.perf_counter() - t:.2f} |")
        return p

    p = timed("1024 from scratch", num_servers=1024, expert_load=load)
    timed("1024 -> 1025", num_servers=1025, expert_load=load, previous=p)
    timed("1024 -> 1023", num_servers=1023, expert_load=load, previous=p)
    timed("1024, load shift", num_servers=1024, expert_load=shifted, previous=p, rebalance=True)
    return "\n".join(out)


def rescale_png(rows: list[dict], path: str) -> None:
    """Balancedness / from scratch per case: load-oblivious step, default budget, no limit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 3.6), dpi=80)
    x = range(len(rows))
    for i, (key, label) in enumerate(
        (("oblivious", "load-oblivious step"), ("default", "default budget 0.1"),
         ("unlimited", "no limit"))
    ):  # fmt: skip
        ax.bar([v + (i - 1) * 0.27 for v in x], [r[f"b_{key}"] / r["b_scratch"] for r in rows],
               0.27, label=label)  # fmt: skip
    ax.axhline(0.95, color="k", lw=0.8, ls="--")
    ax.set_xticks(list(x))
    ax.set_xticklabels([f"{r['load']}\n{r['rescale']}" for r in rows], fontsize=6, rotation=90)
    ax.set_ylabel("balancedness / from scratch")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=7, loc="lower left")
    ax.set_title("Placement after a rescale, 256 experts x 58 layers, R=2", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rescale", action="store_true", help="only the rescale-budget tables")
    ap.add_argument("--png", default="", help="write the rescale figure here")
    args = ap.parse_args()
    from tqdm import tqdm

    print("## Rescale under a movement budget (balancedness, moved share of replicas)\n")
    rows = list(tqdm(rescale_rows(args.quick), desc="rescale", total=21))
    print(rescale_table(rows))
    if args.png:
        rescale_png(rows, args.png)
    if not args.quick:
        print("\n## Placement time at 1024 servers x 58 layers x 256 experts\n")
        print(speed_table())
    if args.rescale:
        return

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
