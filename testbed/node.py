"""What a process node's pod workers share: the apiserver clients, the node's pod IPs and fake
GPUs, kubelet Events, and configMap/secret reads. The agent (:mod:`.agent`) is a :class:`Node`
that also heartbeats and watches its pods."""

from __future__ import annotations

import base64
import datetime as _dt
import ipaddress
import json
import logging
import threading
from pathlib import Path
from typing import Any

from kubernetes import client, config
from kubernetes.client.rest import ApiException

from . import pod as podlogic

log = logging.getLogger("eaas.testbed.agent")

HOST_IP = "127.0.0.1"


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def in_cidr(ip: str, cidr: str) -> bool:
    try:
        return ipaddress.ip_address(ip) in ipaddress.ip_network(cidr)
    except ValueError:
        return False


class Node:
    """One process node's shared state; the pod workers of :mod:`.pod_worker` use it."""

    def __init__(
        self,
        node: str,
        kubeconfig: str,
        state_dir: Path,
        apiserver_port: int,
        restart_backoff_s: float = 10.0,
        volume_sync_s: float = 60.0,
        heartbeat_s: float = 2.0,
        lease_duration_s: int = 40,
    ):
        """Clients of the apiserver from ``kubeconfig``; ``state_dir`` is this node's folder
        (``<testbed state>/nodes/<node>``: pods, logs, the bind shim); the rest are the agent's
        settings (``python -m eaas.testbed.agent --help``)."""
        api = config.new_client_from_config(config_file=kubeconfig)
        # Any: the generated client's stubs want model objects; it takes plain dicts (JSON) too
        self.core: Any = client.CoreV1Api(api)
        self.coord: Any = client.CoordinationV1Api(api)
        self.node = node
        self.kubeconfig = kubeconfig
        self.state_dir = Path(state_dir)
        self.apiserver_port = apiserver_port
        self.restart_backoff_s = restart_backoff_s
        self.volume_sync_s = volume_sync_s
        self.heartbeat_s = heartbeat_s
        self.lease_duration_s = lease_duration_s
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.ips: dict[str, str] = {}  # pod uid -> IP
        self.last_ip: str | None = None  # host-local IPAM: allocate after the last one
        self.gpus_used: dict[str, list[int]] = {}  # "<uid>/<container>" -> indices
        self.pod_cidr = ""
        self.gpu_total = 0
        self.testbed_dir = self.state_dir.parents[1]  # <testbed state>/nodes/<node>
        self.shim_dir = self.state_dir / "shim"
        self.pods_dir = self.state_dir / "pods"
        self.started = now_iso()

    # -- API helpers --------------------------------------------------------------------------
    def get_json(self, fn, *args, **kw) -> dict | None:
        """Call a read API and return the JSON body as a dict, or None on 404."""
        try:
            resp = fn(*args, _preload_content=False, **kw)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        return json.loads(resp.data)

    def config_data(self, kind: str, name: str, ns: str) -> dict[str, bytes] | None:
        """The data of configMap (``kind`` "configmap", ``binaryData`` included) or secret
        ``name`` in namespace ``ns`` (key -> bytes), or None if there is none."""
        if kind == "configmap":
            cm = self.get_json(self.core.read_namespaced_config_map, name, ns)
            if cm is None:
                return None
            out = {k: v.encode() for k, v in (cm.get("data") or {}).items()}
            out.update({k: base64.b64decode(v) for k, v in (cm.get("binaryData") or {}).items()})
            return out
        sec = self.get_json(self.core.read_namespaced_secret, name, ns)
        if sec is None:
            return None
        return {k: base64.b64decode(v) for k, v in (sec.get("data") or {}).items()}

    def event(self, pod: dict, reason: str, message: str, type_: str = "Normal") -> None:
        """Post a kubelet Event about ``pod`` (best effort)."""
        meta = pod["metadata"]
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta["uid"],
            },
            "reason": reason,
            "message": message,
            "type": type_,
            "source": {"component": "kubelet", "host": self.node},
            "firstTimestamp": now_iso(),
            "lastTimestamp": now_iso(),
            "count": 1,
            "reportingComponent": "kubelet",
            "reportingInstance": self.node,
        }
        try:
            self.core.create_namespaced_event(meta["namespace"], body)
        except Exception as e:  # events are best effort, as in the kubelet
            log.debug("event %s failed: %s", reason, e)

    # -- resources ----------------------------------------------------------------------------
    def alloc_ip(self, uid: str, wanted: str | None) -> str:
        """The pod IP of pod ``uid``: its own if it has one, ``wanted`` (its recorded
        ``status.podIP``) if free and in the node's podCIDR, else the next free one."""
        with self.lock:
            if uid in self.ips:
                return self.ips[uid]
            used = set(self.ips.values())
            if wanted and wanted not in used and in_cidr(wanted, self.pod_cidr):
                ip = wanted
            else:
                ip = podlogic.allocate_ip(self.pod_cidr, used, self.last_ip)
                self.last_ip = ip
            self.ips[uid] = ip
            return ip

    def alloc_gpus(self, key: str, count: int) -> list[int]:
        """Fake GPU indices for container ``key`` (``<uid>/<container>``), ``count`` of them."""
        with self.lock:
            if key in self.gpus_used:
                return self.gpus_used[key]
            used = [i for v in self.gpus_used.values() for i in v]
            got = podlogic.allocate_gpus(count, self.gpu_total, used) if count else []
            self.gpus_used[key] = got
            return got

    def release(self, uid: str) -> None:
        """Free the pod IP and the GPUs of pod ``uid``."""
        with self.lock:
            self.ips.pop(uid, None)
            for k in [k for k in self.gpus_used if k.startswith(uid + "/")]:
                del self.gpus_used[k]
