"""Routing table: for every MoE layer and logical expert, its live replicas.

A :class:`RoutingTable` is immutable and versioned. Whoever changes membership (``eaas serve``
locally, the operator in Kubernetes) publishes a new table with a strictly larger ``version``;
attention clients reject tables older than the one they hold and acknowledge the one they use.

JSON form (what the operator writes into the pool's ConfigMap under key ``routing-table.json``)::

    {
      "version": 7,
      "num_experts": 32,
      "servers": {"pool-0": "tcp://10.0.0.5:9000", "pool-1": "unix:/run/eaas/s1.sock"},
      "layers": {"1": [["pool-0", "pool-1"], ...], "2": [...]}
    }

``layers[str(l)][e]`` lists the server ids hosting logical expert ``e`` of model layer ``l``.
Endpoints: ``tcp://HOST:PORT`` (TCP transport) or ``unix:PATH`` (shared-memory transport; the
Unix socket carries the memfd handshake and doorbells).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from eaas.runtime.placement import Placement


class RoutingTableError(ValueError):
    """Malformed routing table (message names the offending field)."""


@dataclass(frozen=True)
class RoutingTable:
    """Versioned map ``(layer, logical expert) -> replicas``.

    Attributes:
        version: monotonically increasing; larger wins.
        num_experts: logical experts per MoE layer.
        servers: server id -> endpoint (``tcp://host:port`` or ``unix:/path``).
        layers: model layer index -> tuple over experts of tuples of server ids.
    """

    version: int
    num_experts: int
    servers: Mapping[str, str]
    layers: Mapping[int, tuple[tuple[str, ...], ...]] = field(default_factory=dict)

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_placement(
        cls,
        placement: Placement,
        server_ids: Sequence[str],
        endpoints: Sequence[str],
        version: int = 1,
    ) -> RoutingTable:
        """Build a table from a placement; ``server_ids[s]``/``endpoints[s]`` name server ``s``."""
        if len(server_ids) != placement.num_servers or len(endpoints) != placement.num_servers:
            raise RoutingTableError(
                f"placement has {placement.num_servers} servers but got {len(server_ids)} ids "
                f"and {len(endpoints)} endpoints"
            )
        reps = placement.replicas()
        layers = {
            layer: tuple(
                tuple(server_ids[s] for s in reps.get((layer, e), ()))
                for e in range(placement.num_experts)
            )
            for layer in placement.layers
        }
        return cls(
            version=version,
            num_experts=placement.num_experts,
            servers=dict(zip(server_ids, endpoints, strict=False)),
            layers=layers,
        )

    def without_servers(self, dead: Iterable[str]) -> RoutingTable:
        """A new table (version + 1) with ``dead`` servers removed from every replica list."""
        dead = set(dead)
        return RoutingTable(
            version=self.version + 1,
            num_experts=self.num_experts,
            servers={k: v for k, v in self.servers.items() if k not in dead},
            layers={
                layer: tuple(tuple(s for s in reps if s not in dead) for reps in experts)
                for layer, experts in self.layers.items()
            },
        )

    # ---- queries ------------------------------------------------------------------------
    def replicas(self, layer: int, expert: int) -> tuple[str, ...]:
        return self.layers[layer][expert]

    def hosted_by(self, server_id: str) -> list[tuple[int, int]]:
        """``(layer, expert)`` pairs whose replica list names ``server_id``."""
        return [
            (layer, e)
            for layer, experts in sorted(self.layers.items())
            for e, reps in enumerate(experts)
            if server_id in reps
        ]

    def uncovered(self) -> list[tuple[int, int]]:
        """``(layer, expert)`` pairs with no replica at all."""
        return [
            (layer, e)
            for layer, experts in sorted(self.layers.items())
            for e, r in enumerate(experts)
            if not r
        ]

    # ---- serialization ------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "version": self.version,
            "num_experts": self.num_experts,
            "servers": dict(sorted(self.servers.items())),
            "layers": {
                str(layer): [list(r) for r in experts]
                for layer, experts in sorted(self.layers.items())
            },
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: Mapping) -> RoutingTable:
        try:
            version = int(d["version"])
            num_experts = int(d["num_experts"])
            servers = {str(k): str(v) for k, v in d["servers"].items()}
            layers = {}
            for k, experts in d["layers"].items():
                if len(experts) != num_experts:
                    raise RoutingTableError(
                        f"layers[{k}] has {len(experts)} experts, expected num_experts={num_experts}"
                    )
                layers[int(k)] = tuple(tuple(str(s) for s in r) for r in experts)
        except KeyError as exc:
            raise RoutingTableError(f"routing table is missing field {exc.args[0]!r}") from None
        except (TypeError, ValueError, AttributeError) as exc:
            if isinstance(exc, RoutingTableError):
                raise
            raise RoutingTableError(f"malformed routing table: {exc}") from None
        for layer, experts in layers.items():
            for e, reps in enumerate(experts):
                for s in reps:
                    if s not in servers:
                        raise RoutingTableError(f"layers[{layer}][{e}] names unknown server {s!r}")
        return cls(version=version, num_experts=num_experts, servers=servers, layers=layers)

    @classmethod
    def from_json(cls, text: str) -> RoutingTable:
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as exc:
            raise RoutingTableError(f"routing table is not valid JSON: {exc}") from None
