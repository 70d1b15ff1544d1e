"""The routing table: for every MoE layer and logical expert, the expert servers hosting a replica.

One type, :class:`RoutingTable`, carries the fact "which servers host which expert" everywhere:
the operator builds it from a placement, an assignment or its observed pods, the attention
clients dispatch by it, the expert servers learn their experts from it
(:meth:`RoutingTable.hosted_by`). Like SGLang's ``ExpertLocationMetadata``
(``sglang/srt/eplb/expert_location.py``) it is one shaped, immutable dataclass whose invariants are
checked when it is built, with named constructors for each source.

A table is versioned. Whoever changes membership (``eaas serve`` locally, the operator in
Kubernetes) publishes a new table with a strictly larger ``version``; attention clients reject
tables older than the one they hold and acknowledge the one they use. The JSON forms are those of
:mod:`eaas.runtime.tables.wire`.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from eaas.runtime.placement import LayerExpert, Placement
from eaas.runtime.tables.wire import (
    LayerReplicas,
    RoutingTableError,
    compact_dict,
    dumps,
    parse_table_dict,
    parse_table_json,
    table_dict,
    wire_text,
)


def _non_negative_int(name: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise RoutingTableError(f"field {name!r} must be an integer >= 0, got {v!r}")
    return v


@dataclass(frozen=True)
class RoutingTable:
    """Versioned map ``(layer, logical expert) -> replicas`` (the server ids hosting it).

    Attributes:
        version: monotonically increasing; larger wins (int >= 0; 0: the empty start).
        num_experts: logical experts per MoE layer (int >= 0).
        servers: server id -> endpoint (``tcp://host:port``, ``unix:/path`` or ``nvshmem:PE``).
        layers: model layer index (int >= 0) -> tuple over experts of tuples of server ids
            (the replicas, in dispatch order).

    Invariants, checked at construction (the fields are normalized to ``dict`` / tuples):
    non-negative integers, every replica names a server of ``servers``, no server twice in one
    replica list. Server ids are unique (keys of ``servers``; the constructors from sequences
    check it).

    Raises:
        RoutingTableError: an invariant does not hold (the message names the field).
    """

    version: int
    num_experts: int
    servers: Mapping[str, str]
    layers: Mapping[int, LayerReplicas] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _non_negative_int("version", self.version)
        _non_negative_int("num_experts", self.num_experts)
        servers = {str(k): str(v) for k, v in self.servers.items()}
        layers: dict[int, LayerReplicas] = {}
        for layer, experts in self.layers.items():
            _non_negative_int("layers", layer)
            reps = tuple(tuple(str(s) for s in r) for r in experts)
            for e, r in enumerate(reps):
                for s in r:
                    if s not in servers:
                        raise RoutingTableError(f"layers[{layer}][{e}] names unknown server {s!r}")
                if len(set(r)) != len(r):
                    raise RoutingTableError(f"layers[{layer}][{e}] names a server twice: {r}")
            layers[int(layer)] = reps
        object.__setattr__(self, "servers", servers)
        object.__setattr__(self, "layers", layers)

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_assignment(
        cls,
        assignment: Mapping[str, Iterable[LayerExpert]],
        endpoints: Mapping[str, str],
        version: int,
        *,
        num_experts: int,
        layers: Iterable[int],
    ) -> RoutingTable:
        """The table of an assignment (server id -> the ``(layer, expert)`` pairs it hosts).

        Args:
            assignment: server id -> pairs (any iterable; a pair listed twice counts once).
            endpoints: server id -> endpoint; its order is the replica order. Servers of
                ``assignment`` not in ``endpoints`` are left out.
            version: the table version.
            num_experts / layers: the model's logical experts per MoE layer and MoE layer
                indices; pairs outside them are ignored (e.g. a pod from an older spec).
        """
        layer_list = list(layers)
        wanted = set(layer_list)
        hosting: dict[LayerExpert, list[str]] = {}
        for sid in endpoints:
            for layer, e in sorted(set(assignment.get(sid, ()))):
                if layer in wanted and 0 <= e < num_experts:
                    hosting.setdefault((layer, e), []).append(sid)
        return cls(
            version=version,
            num_experts=num_experts,
            servers=dict(endpoints),
            layers={
                layer: tuple(tuple(hosting.get((layer, e), ())) for e in range(num_experts))
                for layer in layer_list
            },
        )

    @classmethod
    def from_placement(
        cls,
        placement: Placement,
        server_ids: Sequence[str],
        endpoints: Sequence[str],
        version: int = 1,
    ) -> RoutingTable:
        """The table of a placement: ``server_ids[s]`` / ``endpoints[s]`` name placement server
        ``s``; replicas are listed in server-index order.

        Raises:
            RoutingTableError: lengths differ from ``placement.num_servers``, or an id repeats.
        """
        if len(server_ids) != placement.num_servers or len(endpoints) != placement.num_servers:
            raise RoutingTableError(
                f"placement has {placement.num_servers} servers but got {len(server_ids)} ids "
                f"and {len(endpoints)} endpoints"
            )
        if len(set(server_ids)) != len(server_ids):
            raise RoutingTableError(f"server ids must be unique, got {list(server_ids)}")
        return cls.from_assignment(
            dict(zip(server_ids, placement.servers, strict=True)),
            dict(zip(server_ids, endpoints, strict=True)),
            version,
            num_experts=placement.num_experts,
            layers=placement.layers,
        )

    @classmethod
    def from_dict(cls, d: Mapping) -> RoutingTable:
        """Read the plain or compact form (:mod:`eaas.runtime.tables.wire`) from parsed JSON.

        Raises:
            RoutingTableError: malformed (the message names the field).
        """
        return cls(*parse_table_dict(d))

    @classmethod
    def from_json(cls, text: str | bytes) -> RoutingTable:
        """Parse the JSON text of either form (what :meth:`to_wire` / :meth:`to_json` give).

        Raises:
            RoutingTableError: not JSON, malformed or nested too deeply.
        """
        return cls(*parse_table_json(text))

    from_wire = from_json

    def with_version(self, version: int) -> RoutingTable:
        """The same replicas under another version."""
        return dataclasses.replace(self, version=version)

    def without_servers(self, dead: Iterable[str], version: int | None = None) -> RoutingTable:
        """A new table with ``dead`` servers removed from :attr:`servers` and every replica list
        (the other replicas stay, in their order; an expert whose only replicas were ``dead``
        gets an empty list). ``version``: the new table's version (default ``version + 1``).

        Costs what the removal touches: the replica lists are not checked again (removing
        servers keeps every invariant of a valid table; a 4,096-server DeepSeek-V3 table in
        ~0.02 CPU-s instead of ~0.05). An id of ``dead`` that is not a server is ignored.

        Raises:
            RoutingTableError: ``version`` is not an integer >= 0.
        """
        gone = set(dead) & set(self.servers)
        out = copy.copy(self)  # a frozen dataclass: no __post_init__ again
        new_version = self.version + 1 if version is None else version
        object.__setattr__(out, "version", _non_negative_int("version", new_version))
        object.__setattr__(out, "servers", {k: v for k, v in self.servers.items() if k not in gone})
        if gone:
            object.__setattr__(
                out,
                "layers",
                {
                    layer: tuple(
                        reps if gone.isdisjoint(reps) else tuple(s for s in reps if s not in gone)
                        for reps in experts
                    )
                    for layer, experts in self.layers.items()
                },
            )
        return out

    # ---- queries ------------------------------------------------------------------------
    def replicas(self, layer: int, expert: int) -> tuple[str, ...]:
        """Server ids hosting ``expert`` of ``layer`` (KeyError / IndexError outside the table)."""
        return self.layers[layer][expert]

    def hosted_by(self, server_id: str) -> list[LayerExpert]:
        """``(layer, expert)`` pairs whose replica list names ``server_id``, sorted."""
        return [
            (layer, e)
            for layer, experts in sorted(self.layers.items())
            for e, reps in enumerate(experts)
            if server_id in reps
        ]

    def assignment(self) -> dict[str, frozenset[LayerExpert]]:
        """Server id -> the pairs it hosts, for every server of :attr:`servers` (also those
        hosting nothing)."""
        out: dict[str, set[LayerExpert]] = {sid: set() for sid in self.servers}
        for layer, experts in self.layers.items():
            for e, reps in enumerate(experts):
                for sid in reps:
                    out[sid].add((layer, e))
        return {sid: frozenset(p) for sid, p in out.items()}

    def uncovered(self) -> list[LayerExpert]:
        """``(layer, expert)`` pairs with no replica at all, sorted."""
        return [
            (layer, e)
            for layer, experts in sorted(self.layers.items())
            for e, r in enumerate(experts)
            if not r
        ]

    def coverage(self, redundancy: int) -> tuple[int, int, int]:
        """``(logical experts, below redundancy, uncovered)`` counted over the table."""
        total = below = uncovered = 0
        for experts in self.layers.values():
            for reps in experts:
                total += 1
                below += len(reps) < redundancy
                uncovered += not reps
        return total, below, uncovered

    def same_replicas(self, other: RoutingTable | None) -> bool:
        """Whether ``other`` has the same experts, servers and replicas (any version)."""
        return other is not None and (self.num_experts, self.servers, self.layers) == (
            other.num_experts,
            other.servers,
            other.layers,
        )

    # ---- serialization (the forms of eaas.runtime.tables.wire) ---------------------------
    def to_dict(self) -> dict:
        """The plain JSON form as a dict."""
        return table_dict(self.version, self.num_experts, self.servers, self.layers)

    def to_json(self) -> str:
        """The plain JSON form as text."""
        return dumps(self.to_dict())

    def to_compact_dict(self) -> dict:
        """Inner compact form: servers once (sorted by id), replicas as indices into them."""
        return compact_dict(self.version, self.num_experts, self.servers, self.layers)

    def to_wire(self, compact_over: int = 256 * 1024) -> str:
        """Text to store (ConfigMap, file): the plain JSON form, or the compact envelope
        (``zlib+base64`` of :meth:`to_compact_dict`) when the plain form is longer than
        ``compact_over`` characters. Readable by :meth:`from_json` either way."""
        return wire_text(self.to_dict(), self.to_compact_dict, compact_over)
