"""kopf's per-event work kept independent of the size of the watched objects: a small diff-base
and quiet per-event logs.

kopf builds a diff-base "essence" of every object on every watch event
(``kopf._core.reactor.processing._detect_causes``), for every watched resource, whether or not a
handler reads a diff: its default ``DiffBaseStorage.build`` deep-copies the whole body (status
included, deleted right after) and ``ProgressStorage.clear`` deep-copies the result again. For a
1,024-server pool that was ~2.7 million ``deepcopy`` calls per ~3,200 events
(``docs/measurements/operator-scale.md``). :class:`SpecDiffBaseStorage` builds the essence
from what the operator's change handlers compare (``spec``, labels, annotations) and only for
the resources that have such handlers (the custom resources); pods, ConfigMaps and nodes are
watched by event and index handlers only, whose essence is empty.

kopf logs ``Handler '<name>' succeeded.`` at INFO after each event handler call: one line per
pod, ConfigMap and node event. :class:`QuietWatchHandlers` turns those of the named handlers
into DEBUG records (shown with ``--verbose``).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable
from typing import Any, cast

import kopf

from eaas.operator.crd import GROUP


class SpecDiffBaseStorage(kopf.AnnotationsDiffBaseStorage):
    """kopf's annotation diff-base storage (``<prefix>/<key>`` holds the last handled spec),
    building the essence without copying ``status`` or the system metadata, and an empty one
    for objects outside ``group`` (no change handler compares them)."""

    def __init__(self, *, prefix: str, key: str, group: str = GROUP) -> None:
        super().__init__(prefix=prefix, key=key)
        self.group = group

    def build(
        self, *, body: kopf.Body, extra_fields: Iterable[kopf.FieldSpec] | None = None
    ) -> kopf.BodyEssence:
        """The essence kopf compares: ``spec`` and the labels and annotations (kopf's own
        annotations dropped by the base class) of custom objects of ``group``; ``{}`` for any
        other object (``extra_fields`` are honoured only for custom objects)."""
        if not str(body.get("apiVersion", "")).startswith(f"{self.group}/"):
            return kopf.BodyEssence()
        meta = body.get("metadata") or {}
        small: dict[str, Any] = {"spec": body.get("spec") or {}}
        picked = {k: meta[k] for k in ("labels", "annotations") if k in meta}
        if picked:
            small["metadata"] = picked
        for spec in extra_fields or ():  # status fields a handler watches (none today)
            first = spec.split(".")[0] if isinstance(spec, str) else (list(spec or ()) or [""])[0]
            if first == "status":
                small.setdefault("status", body.get("status") or {})
        return super().build(body=kopf.Body(cast(kopf.RawBody, small)), extra_fields=extra_fields)


class QuietWatchHandlers(logging.Filter):
    """Demote kopf's ``Handler '<name>' succeeded.`` INFO records of the named handlers to
    DEBUG (install it on the ``kopf.objects`` logger)."""

    def __init__(self, handlers: Collection[str]) -> None:
        super().__init__()
        self.messages = frozenset(f"Handler '{h}' succeeded." for h in handlers)

    def filter(self, record: logging.LogRecord) -> bool:
        """Keep every record but those of the named handlers, which are kept (as DEBUG) only
        while their logger is enabled for DEBUG (``--verbose``)."""
        if record.levelno == logging.INFO and record.getMessage() in self.messages:
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True
