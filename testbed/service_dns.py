"""Service names for the testbed's pods (test infrastructure): ``<svc>.<ns>.svc`` resolves.

The testbed has no cluster DNS and no kube-proxy, and its pod IPs are loopback addresses, which
the API server refuses as Service endpoints. So each node agent keeps what a cluster's DNS and
kube-proxy would give a client, for the Services with a selector: the Ready pods it selects
(:func:`service_records`, from a list+watch of Services and pods in every namespace), written
atomically as JSON to ``<node>/shim/service-hosts.json``. The agent's ``sitecustomize`` shim
(``SHIM`` in :mod:`.agent`) answers ``socket.getaddrinfo`` of ``<svc>.<ns>``,
``<svc>.<ns>.svc`` and ``<svc>.<ns>.svc.cluster.local`` from that file, with the Service's
port mapped to the pod's ``targetPort`` (as kube-proxy would), one address per Ready pod in
name order. Names it does not know go to the system resolver.

Bound: a pod turning Ready (or not) is in the file as soon as the watch delivers it (well
under a second on a quiet testbed). Not modelled: ClusterIPs (the Service's own IP is not
routable here), ExternalName Services, session affinity, load spreading (clients take the
first address: a standby operator replica forwards to the leader), Python-less containers
(the shim is Python's).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kubernetes import watch
from kubernetes.client.rest import ApiException

log = logging.getLogger("eaas.testbed.agent")

#: File name of the records in the node's shim folder (the shim reads it on each lookup).
HOSTS_FILE = "service-hosts.json"


def _ready(pod: dict) -> bool:
    conds = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)


def _target_port(port: dict, pod: dict) -> int | None:
    target = port.get("targetPort", port.get("port"))
    if isinstance(target, int):
        return target
    if isinstance(target, str) and target.isdigit():
        return int(target)
    for c in (pod.get("spec") or {}).get("containers") or []:
        for p in c.get("ports") or []:
            if p.get("name") == target and (p.get("protocol") or "TCP") == "TCP":
                return int(p["containerPort"])
    return None


def service_records(services: Iterable[dict], pods: Iterable[dict]) -> dict[str, list[dict]]:
    """Name -> endpoints of every Service with a selector: ``[{"ip": pod IP, "ports":
    {"<service port>": target port}}]``, one per Ready, not terminating pod it selects, in pod
    name order. Names: ``<svc>.<ns>``, ``<svc>.<ns>.svc``, ``<svc>.<ns>.svc.cluster.local``."""
    by_ns: dict[str, list[dict]] = {}
    for pod in pods:
        by_ns.setdefault(pod["metadata"].get("namespace", ""), []).append(pod)
    out: dict[str, list[dict]] = {}
    for svc in services:
        meta, spec = svc["metadata"], svc.get("spec") or {}
        selector = spec.get("selector") or {}
        if not selector:
            continue
        endpoints = []
        for pod in sorted(by_ns.get(meta["namespace"], []), key=lambda p: p["metadata"]["name"]):
            labels = pod["metadata"].get("labels") or {}
            ip = (pod.get("status") or {}).get("podIP")
            if (
                not ip
                or pod["metadata"].get("deletionTimestamp")
                or not _ready(pod)
                or any(labels.get(k) != v for k, v in selector.items())
            ):
                continue
            ports = {
                str(p["port"]): t
                for p in spec.get("ports") or []
                if (t := _target_port(p, pod)) is not None
            }
            endpoints.append({"ip": ip, "ports": ports})
        base = f"{meta['name']}.{meta['namespace']}"
        for name in (base, f"{base}.svc", f"{base}.svc.cluster.local"):
            out[name] = endpoints
    return out


class ServiceDNS:
    """Keeps ``<shim dir>/service-hosts.json`` up to date from two watches (Services, pods in
    every namespace). ``core``: a ``CoreV1Api``; ``stopping``: set to end the threads."""

    def __init__(self, core: Any, shim_dir: Path, stopping: threading.Event) -> None:
        self.core = core
        self.path = Path(shim_dir) / HOSTS_FILE
        self.stopping = stopping
        self.lock = threading.Lock()
        self.objs: dict[str, dict[str, dict]] = {"services": {}, "pods": {}}
        self.written: dict[str, list[dict]] | None = None

    def start(self) -> ServiceDNS:
        for kind, lister in (
            ("services", self.core.list_service_for_all_namespaces),
            ("pods", self.core.list_pod_for_all_namespaces),
        ):
            threading.Thread(
                target=self._loop, args=(kind, lister), name=f"dns-{kind}", daemon=True
            ).start()
        return self

    def _write(self) -> None:
        with self.lock:
            records = service_records(self.objs["services"].values(), self.objs["pods"].values())
            if records == self.written:
                return
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(records))
            os.replace(tmp, self.path)
            self.written = records

    def _loop(self, kind: str, lister: Any) -> None:
        while not self.stopping.is_set():
            try:
                resp = lister(_preload_content=False)
                lst = json.loads(resp.data)
                with self.lock:
                    self.objs[kind] = {o["metadata"]["uid"]: o for o in lst.get("items", [])}
                self._write()
                w = watch.Watch()
                for ev in w.stream(
                    lister, resource_version=lst["metadata"]["resourceVersion"], timeout_seconds=120
                ):
                    if self.stopping.is_set():
                        w.stop()
                        break
                    obj = ev["raw_object"]
                    if ev["type"] == "ERROR":
                        break
                    with self.lock:
                        if ev["type"] == "DELETED":
                            self.objs[kind].pop(obj["metadata"]["uid"], None)
                        else:
                            self.objs[kind][obj["metadata"]["uid"]] = obj
                    self._write()
            except ApiException as e:
                if e.status != 410:
                    log.warning("%s watch (service names): %s", kind, e)
                    self.stopping.wait(1)
            except Exception as e:
                if self.stopping.is_set():
                    break
                log.warning("%s watch (service names): %s", kind, e)
                self.stopping.wait(1)
