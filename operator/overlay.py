"""Pod template overlay (pure): merge a user's ``spec.podTemplate`` into a generated pod.

The merge follows LeaderWorkerSet's and KServe's practice (and Kubernetes' strategic-merge patch
keys for PodSpec): lists of named things are merged by name (containers, volumes, env,
imagePullSecrets; volumeMounts by mountPath), so a user adds a volume or an env var without
restating ours, and an entry with our name replaces ours; ``tolerations`` are appended;
``nodeSelector`` is merged key by key; ``affinity``, ``serviceAccountName``,
``priorityClassName`` and the pod ``securityContext`` are set from the overlay.

Only the keys in :data:`POD_SPEC_KEYS` / :data:`CONTAINER_KEYS` are accepted: anything else
raises :class:`OverlayError` naming the field, so a typo never silently does nothing.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any


class OverlayError(ValueError):
    """A pod template overlay the operator cannot apply (the message names the field)."""


#: PodSpec keys an overlay may set, with how each is merged.
POD_SPEC_KEYS = {
    "containers": "containers",
    "volumes": "by-name",
    "imagePullSecrets": "by-name",
    "tolerations": "append",
    "nodeSelector": "dict",
    "affinity": "set",
    "serviceAccountName": "set",
    "priorityClassName": "set",
    "securityContext": "set",
}

#: Container keys an overlay may set on one of our containers (by name), with how each is merged.
CONTAINER_KEYS = {
    "name": "set",
    "env": "by-name",
    "envFrom": "append",
    "volumeMounts": "by-mountPath",
    "securityContext": "set",
}


def _merge_list(base: Sequence[Any], extra: Sequence[Any], key: str, where: str) -> list[Any]:
    """``base`` with each entry of ``extra`` replacing the one with the same ``key`` or added."""
    out = [copy.deepcopy(x) for x in base]
    index = {x.get(key): i for i, x in enumerate(out) if isinstance(x, Mapping)}
    for i, item in enumerate(extra):
        if not isinstance(item, Mapping) or not item.get(key):
            raise OverlayError(f"{where}[{i}]: an object with a {key!r} is required")
        if item[key] in index:
            out[index[item[key]]] = copy.deepcopy(dict(item))
        else:
            index[item[key]] = len(out)
            out.append(copy.deepcopy(dict(item)))
    return out


def _merge_field(target: dict[str, Any], key: str, value: Any, how: str, where: str) -> None:
    if how == "set":
        target[key] = copy.deepcopy(value)
        return
    if how == "dict":
        if not isinstance(value, Mapping):
            raise OverlayError(f"{where}: an object is required")
        target[key] = {**(target.get(key) or {}), **value}
        return
    if not isinstance(value, list):
        raise OverlayError(f"{where}: a list is required")
    if how == "append":
        have = list(target.get(key) or [])
        target[key] = have + [copy.deepcopy(v) for v in value if v not in have]
    elif how == "by-name":
        target[key] = _merge_list(target.get(key) or [], value, "name", where)
    elif how == "by-mountPath":
        target[key] = _merge_list(target.get(key) or [], value, "mountPath", where)
    else:  # pragma: no cover - table above is closed
        raise AssertionError(how)


def _merge_container(base: dict[str, Any], overlay: Mapping[str, Any], where: str) -> None:
    for key, value in overlay.items():
        how = CONTAINER_KEYS.get(key)
        if how is None:
            raise OverlayError(
                f"{where}.{key}: not supported on the operator's container (supported: "
                f"{', '.join(sorted(CONTAINER_KEYS))})"
            )
        _merge_field(base, key, value, how, f"{where}.{key}")


def apply_pod_template(
    pod: Mapping[str, Any], overlay: Mapping[str, Any] | None, field: str = "spec.podTemplate"
) -> dict[str, Any]:
    """A copy of the Pod manifest (or pod template) ``pod`` with ``overlay`` merged in.

    Args:
        pod: a Pod or PodTemplateSpec manifest (``metadata``, ``spec`` with ``containers``).
        overlay: ``spec.podTemplate`` of the pool or fleet (``metadata.labels``,
            ``metadata.annotations``, ``spec``), or None.
        field: the overlay's path in the custom object (error messages).

    Returns:
        The merged manifest. Labels/annotations the operator sets win over the overlay's (the
        operator's selectors must keep matching). Overlay containers with a name the pod
        lacks are added (sidecars) as given.

    Raises:
        OverlayError: an unsupported key or a malformed list entry (the message names it).
    """
    out = copy.deepcopy(dict(pod))
    if not overlay:
        return out
    for key in overlay:
        if key not in ("metadata", "spec"):
            raise OverlayError(f"{field}.{key}: not supported (metadata and spec only)")
    meta = overlay.get("metadata") or {}
    for key, value in meta.items():
        if key not in ("labels", "annotations"):
            raise OverlayError(f"{field}.metadata.{key}: not supported (labels, annotations)")
        if not isinstance(value, Mapping):
            raise OverlayError(f"{field}.metadata.{key}: an object is required")
        ours = out.setdefault("metadata", {}).get(key) or {}
        out["metadata"][key] = {**{k: str(v) for k, v in value.items()}, **ours}
    spec = out.setdefault("spec", {})
    for key, value in (overlay.get("spec") or {}).items():
        how = POD_SPEC_KEYS.get(key)
        where = f"{field}.spec.{key}"
        if how is None:
            raise OverlayError(
                f"{where}: not supported (supported: {', '.join(sorted(POD_SPEC_KEYS))})"
            )
        if how != "containers":
            _merge_field(spec, key, value, how, where)
            continue
        if not isinstance(value, list):
            raise OverlayError(f"{where}: a list is required")
        containers = spec.setdefault("containers", [])
        by_name = {c["name"]: c for c in containers}
        for i, c in enumerate(value):
            if not isinstance(c, Mapping) or not c.get("name"):
                raise OverlayError(f"{where}[{i}]: an object with a 'name' is required")
            if c["name"] in by_name:
                _merge_container(by_name[c["name"]], c, f"{where}[{i}]")
            else:
                if not c.get("image"):
                    raise OverlayError(f"{where}[{i}]: a sidecar container needs an 'image'")
                containers.append(copy.deepcopy(dict(c)))
    return out
