"""The placement's types: :class:`Placement` (which expert server hosts which (layer, logical
expert)), :class:`PlacementError`, the policies and the automatic slot budget."""

from __future__ import annotations

from collections.abc import Sequence
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
        redundancy: minimum replicas of every logical expert (some may have more).
        servers: ``servers[s]`` is the sorted tuple of ``(layer, expert)`` hosted by server ``s``.
        slots_per_server: the per-layer slot budget used (0: none, exactly ``redundancy``).
        domain_spread: True when the replicas of every expert span at least ``redundancy``
            failure domains (so ``redundancy - 1`` domains may fail). False when the pool does
            not allow it (fewer domains than ``redundancy``, or too few free slots in them);
            the placement then still uses as many domains per expert as it can.
    """

    layers: tuple[int, ...]
    num_experts: int
    redundancy: int
    servers: tuple[tuple[LayerExpert, ...], ...]
    slots_per_server: int = 0
    domain_spread: bool = True

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


def auto_slots(num_experts: int, redundancy: int, num_servers: int) -> int:
    """The smallest per-layer slot budget that fits ``redundancy`` replicas of every expert:
    ``ceil(num_experts * redundancy / num_servers)``."""
    return -(-num_experts * redundancy // num_servers)
