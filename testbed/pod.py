"""Pure decisions of the testbed's node agent (the kubelet of a process node).

Everything here is a function of plain pod/container dicts (the API server's JSON, camelCase
keys) and numbers; the agent (:mod:`.agent`) does the I/O. Semantics follow the kubelet:

* environment: https://kubernetes.io/docs/tasks/inject-data-application/define-environment-variable-container/
  (``$(VAR)`` expansion, ``$$`` escape), downward API fields:
  https://kubernetes.io/docs/concepts/workloads/pods/downward-api/
* restart policy and back-off (10 s doubling, capped at 300 s):
  https://kubernetes.io/docs/concepts/workloads/pods/pod-lifecycle/#restart-policy
* probes: https://kubernetes.io/docs/concepts/configuration/liveness-readiness-startup-probes/
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Iterable

#: Probe field defaults (seconds / counts), as in the Pod API.
PROBE_DEFAULTS = {
    "initialDelaySeconds": 0,
    "periodSeconds": 10,
    "timeoutSeconds": 1,
    "successThreshold": 1,
    "failureThreshold": 3,
}


class PodConfigError(ValueError):
    """The pod asks for something the node agent cannot provide (unsupported volume type,
    unknown downward-API field, missing ConfigMap key...). The message names the field; the
    agent shows it as the container's waiting message (reason ``CreateContainerConfigError``)."""


_FIELD_RE = re.compile(r"^metadata\.(labels|annotations)\['([^']+)'\]$")


def field_ref(pod: dict, path: str, pod_ip: str, host_ip: str) -> str:
    """Value of a downward-API ``fieldRef.fieldPath`` for ``pod``.

    Supported: ``metadata.name|namespace|uid``, ``metadata.labels['k']``,
    ``metadata.annotations['k']``, ``metadata.labels``/``metadata.annotations`` (``k="v"``
    lines, as in a downwardAPI volume), ``spec.nodeName``, ``spec.serviceAccountName``,
    ``status.podIP(s)``, ``status.hostIP(s)``.

    Raises:
        PodConfigError: any other path.
    """
    meta = pod.get("metadata", {})
    spec = pod.get("spec", {})
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", "default"),
        "status.podIP": pod_ip,
        "status.podIPs": pod_ip,
        "status.hostIP": host_ip,
        "status.hostIPs": host_ip,
    }
    if path in simple:
        return simple[path]
    m = _FIELD_RE.match(path)
    if m:
        return (meta.get(m.group(1)) or {}).get(m.group(2), "")
    if path in ("metadata.labels", "metadata.annotations"):
        d = meta.get(path.split(".")[1]) or {}
        return "".join(f'{k}="{v}"\n' for k, v in sorted(d.items()))
    raise PodConfigError(f"fieldRef.fieldPath {path!r} is not supported")


def resource_field_ref(container: dict, resource: str, divisor: str | None = None) -> str:
    """Value of ``resourceFieldRef`` (``limits.cpu``, ``requests.memory``...): the declared
    quantity as written (the divisor is not applied; only ``1`` is accepted).

    Raises:
        PodConfigError: a divisor other than 1, or an unknown resource path.
    """
    if divisor not in (None, "1", 1):
        raise PodConfigError(f"resourceFieldRef.divisor {divisor!r} is not supported")
    kind, _, name = resource.partition(".")
    if kind not in ("limits", "requests") or not name:
        raise PodConfigError(f"resourceFieldRef.resource {resource!r} is not supported")
    res = container.get("resources", {}) or {}
    value = (res.get(kind) or {}).get(name)
    if value is None and kind == "requests":
        value = (res.get("limits") or {}).get(name)
    return str(value) if value is not None else "0"


_VAR_RE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(s: str, env: dict[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: ``$(VAR)`` becomes ``env[VAR]`` if defined, else
    stays as written; ``$$`` becomes ``$``."""

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _VAR_RE.sub(sub, s)


Lookup = Callable[[str, str], "dict[str, str] | None"]


def container_env(
    pod: dict,
    container: dict,
    pod_ip: str,
    host_ip: str,
    base: dict[str, str],
    lookup: Lookup,
) -> dict[str, str]:
    """The environment of ``container``: ``base`` (the image's env and the kubelet's service
    variables), then ``envFrom``, then ``env`` in order, each value ``$(VAR)``-expanded
    against the variables defined before it.

    ``lookup(kind, name)`` returns the data of ConfigMap (``kind="configmap"``) or Secret
    (``"secret"``, values already decoded) ``name`` in the pod's namespace, or None if absent.

    Raises:
        PodConfigError: a referenced ConfigMap/Secret/key is missing and not ``optional``, or an
            unsupported ``valueFrom``.
    """
    env = dict(base)
    for src in container.get("envFrom") or []:
        prefix = src.get("prefix", "")
        for kind, key in (("configmap", "configMapRef"), ("secret", "secretRef")):
            ref = src.get(key)
            if ref is None:
                continue
            data = lookup(kind, ref["name"])
            if data is None:
                if ref.get("optional"):
                    continue
                raise PodConfigError(f"envFrom.{key}: {kind} {ref['name']!r} not found")
            env.update({prefix + k: v for k, v in data.items()})
    for var in container.get("env") or []:
        name = var["name"]
        if "valueFrom" not in var:
            env[name] = expand(var.get("value", ""), env)
            continue
        vf = var["valueFrom"]
        if "fieldRef" in vf:
            env[name] = field_ref(pod, vf["fieldRef"]["fieldPath"], pod_ip, host_ip)
        elif "resourceFieldRef" in vf:
            r = vf["resourceFieldRef"]
            env[name] = resource_field_ref(container, r["resource"], r.get("divisor"))
        elif "configMapKeyRef" in vf or "secretKeyRef" in vf:
            key = "configMapKeyRef" if "configMapKeyRef" in vf else "secretKeyRef"
            ref = vf[key]
            data = lookup("configmap" if key == "configMapKeyRef" else "secret", ref["name"])
            if data is None or ref["key"] not in data:
                if ref.get("optional"):
                    continue
                raise PodConfigError(f"env {name}: {key} {ref['name']}/{ref['key']} not found")
            env[name] = data[ref["key"]]
        else:
            raise PodConfigError(f"env {name}: valueFrom {sorted(vf)} is not supported")
    return env


def command_line(container: dict, env: dict[str, str]) -> list[str]:
    """``command`` + ``args`` with ``$(VAR)`` expanded.

    Raises:
        PodConfigError: no ``command`` (there is no image to supply an entrypoint).
    """
    command = container.get("command") or []
    if not command:
        raise PodConfigError(
            f"container {container['name']!r}: no command; process nodes run no image, so the "
            "entrypoint must be in spec.containers[].command"
        )
    return [expand(a, env) for a in [*command, *(container.get("args") or [])]]


def should_restart(restart_policy: str, exit_code: int) -> bool:
    """Whether a container that exited with ``exit_code`` is started again."""
    if restart_policy == "Always":
        return True
    if restart_policy == "OnFailure":
        return exit_code != 0
    return False


def backoff_s(restart_count: int, base_s: float = 10.0, cap_s: float = 300.0) -> float:
    """Delay before restart number ``restart_count + 1``: ``base_s * 2**restart_count``,
    capped at ``cap_s`` (the kubelet's crash-loop back-off; restart 0 waits ``base_s``)."""
    return min(cap_s, base_s * (2 ** min(restart_count, 30)))


def pod_phase(restart_policy: str, containers: Iterable[dict]) -> str:
    """Pod phase from the containers' runtime facts.

    Each item: ``{"started": bool (ever started), "running": bool, "exit_code": int | None}``.
    Pending until every container started once; Running while any runs or will restart;
    then Succeeded (all exited 0) or Failed.
    """
    cs = list(containers)
    if not cs or not all(c["started"] for c in cs):
        return "Pending"
    if any(c["running"] for c in cs):
        return "Running"
    codes = [c["exit_code"] for c in cs]
    if any(should_restart(restart_policy, code if code is not None else 1) for code in codes):
        return "Running"
    return "Succeeded" if all(code == 0 for code in codes) else "Failed"


def allocate_ip(cidr: str, used: Iterable[str], last: str | None = None) -> str:
    """The first free host address of ``cidr`` after ``last`` (the previous allocation),
    wrapping around; the lowest free one when ``last`` is None. The first address (``.1``) is
    the node's own and is skipped, as a bridge CNI does. Like the host-local IPAM plugin, a
    freed address is not handed out again at once, so a replacement pod gets a new IP.

    Raises:
        RuntimeError: the range is exhausted.
    """
    net = ipaddress.ip_network(cidr)
    hosts = [str(h) for i, h in enumerate(net.hosts()) if i > 0]
    taken = set(used)
    start = hosts.index(last) + 1 if last in hosts else 0
    for ip in hosts[start:] + hosts[:start]:
        if ip not in taken:
            return ip
    raise RuntimeError(f"pod CIDR {cidr} exhausted")


def allocate_gpus(count: int, total: int, used: Iterable[int]) -> list[int]:
    """``count`` free device indices out of ``0..total-1`` (lowest first), as the NVIDIA
    device plugin hands out whole GPUs.

    Raises:
        RuntimeError: fewer than ``count`` are free (the scheduler should have prevented it).
    """
    taken = set(used)
    free = [i for i in range(total) if i not in taken]
    if len(free) < count:
        raise RuntimeError(f"need {count} GPUs, {len(free)} of {total} free")
    return free[:count]


def gpu_request(container: dict) -> int:
    """Whole ``nvidia.com/gpu`` of a container (limits, else requests)."""
    res = container.get("resources", {}) or {}
    value = (res.get("limits") or {}).get("nvidia.com/gpu") or (res.get("requests") or {}).get(
        "nvidia.com/gpu"
    )
    return int(value or 0)


def probe_settings(probe: dict) -> dict:
    """``probe`` with the API defaults filled in."""
    return {**PROBE_DEFAULTS, **{k: v for k, v in probe.items() if v is not None}}


def resolve_port(container: dict, port: int | str) -> int:
    """A probe's ``port``: a number, or the name of one of the container's ``ports``.

    Raises:
        PodConfigError: unknown port name.
    """
    if isinstance(port, int) or (isinstance(port, str) and port.isdigit()):
        return int(port)
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise PodConfigError(f"container {container['name']!r}: no port named {port!r}")


#: The pod conditions the node agent owns (others: PodScheduled, readiness gates,
#: DisruptionTarget, are left to their writers).
AGENT_CONDITIONS = ("PodReadyToStartContainers", "Initialized", "ContainersReady", "Ready")


def status_drift(api: dict, observed: dict) -> list[str]:
    """What of the node agent's own part of a pod's status the API server's copy (``api``: the
    pod's ``status`` as the watch last delivered it) has differently from what the agent
    observes (``observed``: the status it would post): ``phase``, ``podIP``, the
    :data:`AGENT_CONDITIONS`' status, each container's ``ready`` / ``started`` /
    ``restartCount``. Someone else wrote it (the node-lifecycle controller marks every pod of a
    NotReady node Ready=False, and never back) or the agent's last write was lost; a kubelet
    writes it back. Returns the differing fields' names ([] : none)."""
    out = [k for k in ("phase", "podIP") if api.get(k) != observed.get(k)]

    def conds(s: dict) -> dict[str, str]:
        return {
            c.get("type", ""): c.get("status", "")
            for c in s.get("conditions") or []
            if c.get("type") in AGENT_CONDITIONS
        }

    want, have = conds(observed), conds(api)
    out += [f"conditions[{t}]" for t in AGENT_CONDITIONS if want.get(t) != have.get(t)]

    def ctrs(s: dict) -> dict[str, tuple]:
        return {
            c.get("name", ""): (bool(c.get("ready")), bool(c.get("started")), c.get("restartCount"))
            for c in s.get("containerStatuses") or []
        }

    want_c, have_c = ctrs(observed), ctrs(api)
    out += [f"containerStatuses[{n}]" for n in sorted(want_c) if want_c[n] != have_c.get(n)]
    return out
