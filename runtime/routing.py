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

Compact form (:meth:`RoutingTable.to_wire` when the plain form is large; a ConfigMap holds at most
1 MiB, and a 4096-server pool with redundancy 4 and 63-character names needs ~4 MB as plain JSON)::

    {"version": 7, "encoding": "zlib+base64", "table": "<base64 of zlib of the inner JSON>"}

where the inner JSON names every server once and replicas by index into that list::

    {"version": 7, "num_experts": 32, "servers": [["pool-0", "tcp://10.0.0.5:9000"], ...],
     "layers": {"1": [[0, 1], ...], ...}}

:meth:`RoutingTable.from_json` reads both forms.
Endpoints: ``tcp://HOST:PORT`` (TCP transport) or ``unix:PATH`` (shared-memory transport; the
Unix socket carries the memfd handshake and doorbells).
"""

from __future__ import annotations

import base64
import binascii
import json
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from eaas.runtime.placement import Placement


class RoutingTableError(ValueError):
    """Malformed routing table (message names the offending field)."""


INT64_MAX = 2**63 - 1


def _int_field(d: Mapping, name: str) -> int:
    """``d[name]`` as a JSON integer (KeyError when absent). A string ("3"), a float or a bool
    is refused: a version or count that is not an integer is a producer's bug, not a number to
    guess at. Larger than :data:`INT64_MAX` is refused too.

    Raises:
        RoutingTableError: naming the field and the value.
    """
    v = d[name]
    if isinstance(v, bool) or not isinstance(v, int):
        raise RoutingTableError(f"field {name!r} must be an integer, got {v!r}")
    if v > INT64_MAX:  # Kubernetes integers (the CRD status fields that carry it) are int64
        raise RoutingTableError(f"field {name!r} must be at most 2**63 - 1, got {v}")
    return v


def _json_type(v: object) -> str:
    """JSON's name for the type of a parsed value (``object``, ``list``, ``null``, ...)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, Mapping):
        return "object"
    if isinstance(v, (list, tuple)):
        return "list"
    if isinstance(v, str):
        return "string"
    return "number" if isinstance(v, (int, float)) else type(v).__name__


def _object_field(d: Mapping, name: str) -> Mapping:
    """``d[name]`` as a JSON object (KeyError when absent).

    Raises:
        RoutingTableError: naming the field and the JSON type it has.
    """
    v = d[name]
    if not isinstance(v, Mapping):
        raise RoutingTableError(f"field {name!r} must be an object, got {_json_type(v)}")
    return v


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

    def to_compact_dict(self) -> dict:
        """Inner compact form: servers once (sorted by id), replicas as indices into them."""
        ids = sorted(self.servers)
        index = {sid: i for i, sid in enumerate(ids)}
        return {
            "version": self.version,
            "num_experts": self.num_experts,
            "servers": [[sid, self.servers[sid]] for sid in ids],
            "layers": {
                str(layer): [[index[s] for s in r] for r in experts]
                for layer, experts in sorted(self.layers.items())
            },
        }

    def to_wire(self, compact_over: int = 256 * 1024) -> str:
        """Text to store (ConfigMap, file): the plain JSON form, or the compact envelope
        (``zlib+base64`` of :meth:`to_compact_dict`) when the plain form is longer than
        ``compact_over`` characters. Readable by :meth:`from_json` either way."""
        plain = self.to_json()
        if len(plain) <= compact_over:
            return plain
        inner = json.dumps(self.to_compact_dict(), separators=(",", ":")).encode()
        return json.dumps(
            {
                "version": self.version,
                "encoding": "zlib+base64",
                "table": base64.b64encode(zlib.compress(inner, 9)).decode("ascii"),
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_dict(cls, d: Mapping) -> RoutingTable:
        """Parse the plain or compact form (see the module docstring).

        Raises:
            RoutingTableError: malformed (the message names the field).
        """
        if isinstance(d, Mapping) and "encoding" in d:
            if d["encoding"] != "zlib+base64":
                raise RoutingTableError(f"unknown routing table encoding {d['encoding']!r}")
            try:
                inner = json.loads(zlib.decompress(base64.b64decode(d["table"], validate=True)))
            except RecursionError:
                raise RoutingTableError("compact routing table is nested too deeply") from None
            except (KeyError, TypeError, ValueError, binascii.Error, zlib.error) as exc:
                raise RoutingTableError(
                    f"malformed compact routing table field 'table': {exc}"
                ) from None
            return cls._from_compact(inner)
        if not isinstance(d, Mapping):
            raise RoutingTableError(f"routing table must be a JSON object, got {_json_type(d)}")
        try:
            version = _int_field(d, "version")
            num_experts = _int_field(d, "num_experts")
            servers = {str(k): str(v) for k, v in _object_field(d, "servers").items()}
            layers = {}
            for k, experts in _object_field(d, "layers").items():
                if not isinstance(experts, list) or not all(isinstance(r, list) for r in experts):
                    raise RoutingTableError(
                        f"field 'layers[{k}]' must be a list of replica lists (server ids), "
                        f"got {_json_type(experts)}"
                    )
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
    def _from_compact(cls, d: Mapping) -> RoutingTable:
        try:
            pairs = [(str(sid), str(ep)) for sid, ep in d["servers"]]
            ids = [sid for sid, _ in pairs]
            plain = {
                "version": d["version"],
                "num_experts": d["num_experts"],
                "servers": dict(pairs),
                "layers": {
                    k: [[ids[int(i)] for i in r] for r in experts]
                    for k, experts in d["layers"].items()
                },
            }
        except KeyError as exc:
            raise RoutingTableError(f"routing table is missing field {exc.args[0]!r}") from None
        except (TypeError, ValueError, IndexError, AttributeError) as exc:
            raise RoutingTableError(f"malformed compact routing table: {exc}") from None
        return cls.from_dict(plain)

    @classmethod
    def from_json(cls, text: str) -> RoutingTable:
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as exc:
            raise RoutingTableError(f"routing table is not valid JSON: {exc}") from None
        except RecursionError:  # Python's json recurses per nesting level
            raise RoutingTableError("routing table is nested too deeply") from None
