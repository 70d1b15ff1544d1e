"""The ``--experts`` codec: the (layer, logical expert) pairs an expert server hosts, as the
compact text of a command line (``"1:0-3,7;2:5"``)."""

from __future__ import annotations

from collections.abc import Sequence


def format_expert_spec(pairs: Sequence[tuple[int, int]]) -> str:
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
        for e in experts[1:]:
            if e == prev + 1:
                prev = e
                continue
            ranges.append(str(start) if start == prev else f"{start}-{prev}")
            start = prev = e
        ranges.append(str(start) if start == prev else f"{start}-{prev}")
        parts.append(f"{layer}:{','.join(ranges)}")
    return ";".join(parts)


def parse_expert_spec(spec: str) -> list[tuple[int, int]]:
    """Inverse of :func:`format_expert_spec`.

    Raises:
        ValueError: malformed spec (message quotes the bad part).
    """
    out: list[tuple[int, int]] = []
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
