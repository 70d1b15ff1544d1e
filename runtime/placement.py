"""Placement: which expert server hosts which (layer, logical expert).

Pure functions only; no I/O. Used by ``eaas serve`` (local mode) and by the operator.

Glossary
--------
logical expert
    Expert ``e`` of MoE layer ``l`` as the model defines it (``0 <= e < num_experts``).
physical expert / replica
    One copy of a logical expert's weights on one expert server.
redundancy
    Minimum number of replicas of every logical expert, each on a distinct server, so that
    ``redundancy - 1`` servers can die without any expert losing its last replica.
placement
    For every server index ``s`` in ``[0, num_servers)``, the sorted list of ``(layer, expert)``
    pairs it hosts. Any ``num_servers >= redundancy`` works: there is no divisibility rule
    (monolithic EP needs ``num_servers | num_experts``).
expert load
    Tokens routed to a logical expert per interval; optional input of the ``load-balanced``
    policy. Balancedness = mean server load / max server load (1.0 is perfect).

Policies
--------
``round-robin``
    Enumerate replicas ``(l, e, r)`` layer by layer and deal them to servers in turn. Every layer's
    ``E * R`` replicas spread evenly (each server gets ``floor`` or ``ceil`` of ``E*R/N`` per
    layer), and the ``R`` replicas of one expert land on ``R`` consecutive, hence distinct, servers.
``load-balanced``
    Per layer, greedy longest-processing-time: replicas sorted by expected load (the expert's
    load split evenly across its replicas), each put on the least-loaded server that does not
    already hold that expert. Same distinctness guarantee; better balancedness under skew.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

POLICIES = ("round-robin", "load-balanced")

LayerExpert = tuple[int, int]


class PlacementError(ValueError):
    """Raised when no placement satisfies the request (e.g. redundancy > num_servers)."""


@dataclass(frozen=True)
class Placement:
    """Result of :func:`place_experts`.

    Attributes:
        layers: model layer indices that are MoE layers, ascending.
        num_experts: logical experts per MoE layer.
        redundancy: replicas of every logical expert.
        servers: ``servers[s]`` is the sorted tuple of ``(layer, expert)`` hosted by server ``s``.
    """

    layers: tuple[int, ...]
    num_experts: int
    redundancy: int
    servers: tuple[tuple[LayerExpert, ...], ...]

    @property
    def num_servers(self) -> int:
        return len(self.servers)

    def replicas(self) -> dict[LayerExpert, tuple[int, ...]]:
        """Map ``(layer, expert)`` to the server indices hosting it (ascending)."""
        out: dict[LayerExpert, list[int]] = {}
        for s, pairs in enumerate(self.servers):
            for pair in pairs:
                out.setdefault(pair, []).append(s)
        return {k: tuple(v) for k, v in sorted(out.items())}

    def experts_per_server(self) -> list[int]:
        return [len(p) for p in self.servers]

    def experts_below_redundancy(self, alive: Sequence[int] | None = None) -> int:
        """Count logical experts with fewer than ``redundancy`` replicas on ``alive`` servers
        (all servers when ``alive`` is None)."""
        live = set(range(self.num_servers)) if alive is None else set(alive)
        reps = self.replicas()
        count = 0
        for layer in self.layers:
            for e in range(self.num_experts):
                n = sum(1 for s in reps.get((layer, e), ()) if s in live)
                if n < self.redundancy:
                    count += 1
        return count


def place_experts(
    layers: Sequence[int],
    num_experts: int,
    num_servers: int,
    redundancy: int = 2,
    policy: str = "round-robin",
    expert_load: Mapping[LayerExpert, float] | None = None,
) -> Placement:
    """Compute a placement of every logical expert on ``redundancy`` distinct servers.

    Args:
        layers: MoE layer indices (e.g. DeepSeek-V3: ``range(3, 61)``, 58 layers).
        num_experts: routed experts per MoE layer (DeepSeek-V3: 256).
        num_servers: expert servers (one GPU each by default); any value ``>= redundancy``.
        redundancy: replicas per logical expert, on distinct servers.
        policy: one of :data:`POLICIES`.
        expert_load: tokens per ``(layer, expert)`` per interval, for ``load-balanced``;
            missing entries count as 1.0.

    Returns:
        A :class:`Placement`.

    Raises:
        PlacementError: ``num_servers < 1``, ``redundancy < 1``, ``redundancy > num_servers``,
            ``num_experts < 1`` or an unknown policy.
    """
    layers = tuple(sorted(int(x) for x in layers))
    if num_servers < 1:
        raise PlacementError(f"num_servers must be >= 1, got {num_servers}")
    if redundancy < 1:
        raise PlacementError(f"redundancy must be >= 1, got {redundancy}")
    if redundancy > num_servers:
        raise PlacementError(
            f"redundancy ({redundancy}) cannot exceed the number of servers ({num_servers}): "
            "replicas of one expert must sit on distinct servers"
        )
    if num_experts < 1:
        raise PlacementError(f"num_experts must be >= 1, got {num_experts}")
    if policy not in POLICIES:
        raise PlacementError(f"unknown placement policy {policy!r}; expected one of {POLICIES}")

    hosted: list[list[LayerExpert]] = [[] for _ in range(num_servers)]
    if policy == "round-robin":
        k = 0
        for layer in layers:
            for e in range(num_experts):
                for _ in range(redundancy):
                    hosted[k % num_servers].append((layer, e))
                    k += 1
    else:
        load = expert_load or {}
        for layer in layers:
            # Per-layer LPT: layers run one after another, so each layer must balance on its own.
            server_load = [(0.0, len(hosted[s]), s) for s in range(num_servers)]
            items = []
            for e in range(num_experts):
                share = float(load.get((layer, e), 1.0)) / redundancy
                items.extend((share, e) for _ in range(redundancy))
            items.sort(key=lambda t: (-t[0], t[1]))
            heapq.heapify(server_load)
            for share, e in items:
                skipped = []
                while True:
                    cur, n, s = heapq.heappop(server_load)
                    if (layer, e) not in hosted[s]:
                        break
                    skipped.append((cur, n, s))
                hosted[s].append((layer, e))
                heapq.heappush(server_load, (cur + share, n + 1, s))
                for item in skipped:
                    heapq.heappush(server_load, item)
    return Placement(
        layers=layers,
        num_experts=num_experts,
        redundancy=redundancy,
        servers=tuple(tuple(sorted(h)) for h in hosted),
    )


def format_expert_spec(pairs: Sequence[LayerExpert]) -> str:
    """Compact text form of hosted experts for a command line: ``"1:0-3,7;2:5"``.

    Layers separated by ``;``, each ``layer:ranges`` with comma-separated ``a`` or ``a-b``.
    """
    by_layer: dict[int, list[int]] = {}
    for layer, e in sorted(pairs):
        by_layer.setdefault(layer, []).append(e)
    parts = []
    for layer, experts in by_layer.items():
        ranges = []
        start = prev = experts[0]
        for e in experts[1:] + [None]:  # type: ignore[list-item]
            if e is not None and e == prev + 1:
                prev = e
                continue
            ranges.append(str(start) if start == prev else f"{start}-{prev}")
            if e is not None:
                start = prev = e
        parts.append(f"{layer}:{','.join(ranges)}")
    return ";".join(parts)


def parse_expert_spec(spec: str) -> list[LayerExpert]:
    """Inverse of :func:`format_expert_spec`.

    Raises:
        ValueError: malformed spec (message quotes the bad part).
    """
    out: list[LayerExpert] = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        try:
            layer_s, ranges = part.split(":", 1)
            layer = int(layer_s)
            for r in filter(None, ranges.split(",")):
                if "-" in r:
                    a, b = (int(x) for x in r.split("-", 1))
                    if b < a:
                        raise ValueError
                    out.extend((layer, e) for e in range(a, b + 1))
                else:
                    out.append((layer, int(r)))
        except ValueError:
            raise ValueError(
                f"malformed expert spec part {part!r} (expected 'layer:a-b,c')"
            ) from None
    return sorted(set(out))
