"""Wire codec of the routing table: the JSON forms a table travels in (pure, standard library).

Plain form (what the operator writes into the pool's ConfigMap under key ``routing-table.json``,
and the body of ``PUT /routing-table``)::

    {
      "version": 7,
      "num_experts": 32,
      "servers": {"pool-0": "tcp://10.0.0.5:9000", "pool-1": "unix:/run/eaas/s1.sock"},
      "layers": {"1": [["pool-0", "pool-1"], ...], "2": [...]}
    }

``layers[str(l)][e]`` lists the server ids hosting logical expert ``e`` of model layer ``l``.

Compact form (:func:`wire_text` when the plain form is large; a ConfigMap holds at most 1 MiB,
and a 4096-server pool with redundancy 4 and 63-character names needs ~4 MB as plain JSON)::

    {"version": 7, "encoding": "zlib+base64", "table": "<base64 of zlib of the inner JSON>"}

where the inner JSON names every server once and replicas by index into that list::

    {"version": 7, "num_experts": 32, "servers": [["pool-0", "tcp://10.0.0.5:9000"], ...],
     "layers": {"1": [[0, 1], ...], ...}}

:func:`parse_table_dict` / :func:`parse_table_json` read both forms into :class:`TableFields`;
:class:`eaas.runtime.tables.table.RoutingTable` checks the invariants (known servers, ...).
Endpoints: ``tcp://HOST:PORT`` (TCP transport), ``unix:PATH`` (shared-memory transport; the
Unix socket carries the memfd handshake and doorbells) or ``nvshmem:PE``.
"""

from __future__ import annotations

import base64
import binascii
import json
import zlib
from collections.abc import Callable, Mapping
from typing import NamedTuple

#: Replica lists of one MoE layer: ``layer[e]`` is the tuple of server ids hosting expert ``e``.
LayerReplicas = tuple[tuple[str, ...], ...]

#: Largest integer a table field may hold: Kubernetes integers (the CRD status fields that carry
#: the version) are int64.
INT64_MAX = 2**63 - 1

ENCODING = "zlib+base64"


class RoutingTableError(ValueError):
    """Malformed routing table (message names the offending field)."""


class TableFields(NamedTuple):
    """The four fields of a routing table as parsed from the wire (not yet checked as a table)."""

    version: int
    num_experts: int
    servers: dict[str, str]
    layers: dict[int, LayerReplicas]


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
    if v > INT64_MAX:
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


# ---- encoding -------------------------------------------------------------------------------
def table_dict(
    version: int, num_experts: int, servers: Mapping[str, str], layers: Mapping[int, LayerReplicas]
) -> dict:
    """The plain form (servers and layers sorted, so equal tables give equal text)."""
    return {
        "version": version,
        "num_experts": num_experts,
        "servers": dict(sorted(servers.items())),
        "layers": {
            str(layer): [list(r) for r in experts] for layer, experts in sorted(layers.items())
        },
    }


def compact_dict(
    version: int, num_experts: int, servers: Mapping[str, str], layers: Mapping[int, LayerReplicas]
) -> dict:
    """Inner compact form: servers once (sorted by id), replicas as indices into them."""
    ids = sorted(servers)
    index = {sid: i for i, sid in enumerate(ids)}
    return {
        "version": version,
        "num_experts": num_experts,
        "servers": [[sid, servers[sid]] for sid in ids],
        "layers": {
            str(layer): [[index[s] for s in r] for r in experts]
            for layer, experts in sorted(layers.items())
        },
    }


def dumps(doc: Mapping) -> str:
    """JSON text without spaces (the form every table is stored and sent in)."""
    return json.dumps(doc, separators=(",", ":"))


def wire_text(
    plain: Mapping, compact: Callable[[], Mapping], compact_over: int = 256 * 1024
) -> str:
    """Text to store (ConfigMap, file): ``plain`` as JSON, or the compact envelope (``zlib+base64``
    of ``compact()``, built only then) when the plain text is longer than ``compact_over``
    characters. Readable by :func:`parse_table_json` either way."""
    text = dumps(plain)
    if len(text) <= compact_over:
        return text
    inner = dumps(compact()).encode()
    return dumps(
        {
            "version": plain["version"],
            "encoding": ENCODING,
            "table": base64.b64encode(zlib.compress(inner, 9)).decode("ascii"),
        }
    )


# ---- decoding -------------------------------------------------------------------------------
def parse_table_dict(d: Mapping) -> TableFields:
    """Parse the plain or compact form (see the module docstring) into its fields.

    Checks the JSON types, ``num_experts`` replica lists per layer; server ids naming a listed
    server are checked by the table's constructor.

    Raises:
        RoutingTableError: malformed (the message names the field).
    """
    if isinstance(d, Mapping) and "encoding" in d:
        if d["encoding"] != ENCODING:
            raise RoutingTableError(f"unknown routing table encoding {d['encoding']!r}")
        try:
            inner = json.loads(zlib.decompress(base64.b64decode(d["table"], validate=True)))
        except RecursionError:
            raise RoutingTableError("compact routing table is nested too deeply") from None
        except (KeyError, TypeError, ValueError, binascii.Error, zlib.error) as exc:
            raise RoutingTableError(
                f"malformed compact routing table field 'table': {exc}"
            ) from None
        return _parse_compact(inner)
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
    return TableFields(version, num_experts, servers, layers)


def _parse_compact(d: Mapping) -> TableFields:
    try:
        pairs = [(str(sid), str(ep)) for sid, ep in d["servers"]]
        ids = [sid for sid, _ in pairs]
        plain = {
            "version": d["version"],
            "num_experts": d["num_experts"],
            "servers": dict(pairs),
            "layers": {
                k: [[ids[int(i)] for i in r] for r in experts] for k, experts in d["layers"].items()
            },
        }
    except KeyError as exc:
        raise RoutingTableError(f"routing table is missing field {exc.args[0]!r}") from None
    except (TypeError, ValueError, IndexError, AttributeError) as exc:
        raise RoutingTableError(f"malformed compact routing table: {exc}") from None
    return parse_table_dict(plain)


def parse_table_json(text: str | bytes) -> TableFields:
    """Parse JSON text of either form.

    Raises:
        RoutingTableError: not JSON, nested deeper than Python's recursion limit, or malformed.
    """
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RoutingTableError(f"routing table is not valid JSON: {exc}") from None
    except RecursionError:  # Python's json recurses per nesting level
        raise RoutingTableError("routing table is nested too deeply") from None
    return parse_table_dict(doc)
