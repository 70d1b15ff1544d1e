"""Node agent: the kubelet of one testbed *process node* (test infrastructure, not product code).

One agent process per process node (``python -m eaas.testbed.agent --node NAME ...``, started
by ``eaas testbed up`` and ``eaas testbed node start NAME``). It watches the pods bound to its
node (the kubernetes client's watch, field selector ``spec.nodeName``) and runs them:

* each container's ``command`` + ``args`` is a local process (no image is pulled: the
  testbed's single "image" is the local ``eaas`` install; ``PATH`` starts with the agent's
  Python environment), with the pod's env (``value``, downward-API ``fieldRef`` /
  ``resourceFieldRef``, ``configMapKeyRef``/``secretKeyRef``, ``envFrom``, ``$(VAR)``
  expansion), ``workingDir``, ``KUBERNETES_SERVICE_HOST/PORT`` pointing at the testbed
  apiserver, ``HOSTNAME``;
* the pod gets an IP of the node's ``podCIDR`` (127.1.<node>.<n>, loopback), set as
  ``status.podIP``. Python processes that bind the wildcard address (``0.0.0.0``, ``::``,
  ``""``) bind the pod IP instead (a ``sitecustomize`` on ``PYTHONPATH``, reading
  ``EAAS_TESTBED_POD_IP``): the testbed's stand-in for a pod network namespace;
* volumes (configMap, secret, projected incl. the service-account token from the TokenRequest
  API and ``kube-root-ca.crt``, downwardAPI, emptyDir, hostPath) appear at their
  ``mountPath`` in a private mount namespace per container (:mod:`.podinit`); configMap,
  secret, projected and downwardAPI contents are refreshed every ``--volume-sync-s`` seconds
  (default 60, like the kubelet's sync period; per pod: annotation
  ``testbed.eaas.io/volume-sync-seconds``), written atomically (``..data`` symlink swap);
* startup / liveness / readiness probes (httpGet, tcpSocket, exec) drive ``started``,
  restarts and the ``Ready``/``ContainersReady`` conditions; ``containerStatuses`` (state,
  lastState, exitCode, restartCount), init containers, ``phase``; ``restartPolicy`` with the
  kubelet's back-off (``--restart-backoff-s`` doubling to 300 s);
* deletion: SIGTERM to the container's process group, ``deletionGracePeriodSeconds``, SIGKILL,
  then the pod object is deleted (grace 0, UID precondition), as a kubelet finalizes it;
* node ``Lease`` (``kube-node-lease``) renewed every ``--heartbeat-s`` and node status
  conditions, so stopping the agent makes the node NotReady through the real
  node-lifecycle controller;
* GPUs: each container gets ``CUDA_VISIBLE_DEVICES``/``NVIDIA_VISIBLE_DEVICES`` of the fake
  GPU indices allocated to it out of the node's ``nvidia.com/gpu`` (empty when none), as the
  NVIDIA device plugin would.

Containers die with the agent: ``PR_SET_PDEATHSIG`` (set by :mod:`.podinit`) for the main
process, and the agent kills each container's process group on SIGTERM/SIGINT (a node
power-off: nothing is reported to the API server). Logs: ``<state>/pods/<ns>_<pod>_<uid8>/
<container>-<restart>.log`` (there is no kubelet API, so ``kubectl logs`` does not work).

Not supported (the container shows ``CreateContainerConfigError`` naming the field): volume
types other than the above (PVCs...), gRPC probes, ``subPath`` on refreshed volumes keeps the
first content (as in Kubernetes); lifecycle hooks are ignored.
"""

from __future__ import annotations

import argparse
import base64
import datetime as _dt
import http.client
import json
import logging
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import pod as podlogic
from .cluster import CONTAINER_MARKER, POD_MARKER, STATE_MARKER, kill_marked

log = logging.getLogger("eaas.testbed.agent")

HOST_IP = "127.0.0.1"
PODINIT = str(Path(__file__).with_name("podinit.py"))
VOLUME_SYNC_ANNOTATION = "testbed.eaas.io/volume-sync-seconds"
#: Host variables the local "image" keeps (the image's own ENV in a real cluster).
IMAGE_ENV = (
    "HOME",
    "LANG",
    "LC_ALL",
    "TZ",
    "EAAS_CACHE_DIR",
    "HF_HOME",
    "HF_HUB_CACHE",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "TORCH_HOME",
)
MAX_BACKOFF_S = 300.0
BACKOFF_RESET_S = 600.0  # a container that ran this long restarts its back-off from the base

# sitecustomize for Python containers: wildcard binds go to the pod IP (see module doc).
SHIM = '''"""Testbed pod network stand-in: a wildcard bind binds the pod IP (EAAS_TESTBED_POD_IP)."""
import os as _os
import socket as _socket

_ip = _os.environ.get("EAAS_TESTBED_POD_IP")
if _ip:
    _bind = _socket.socket.bind

    def _pod_bind(self, address):
        if isinstance(address, tuple) and address and address[0] in ("", "0.0.0.0", "::"):
            if self.family == _socket.AF_INET:
                address = (_ip, *address[1:])
            elif self.family == _socket.AF_INET6:
                address = ("::ffff:" + _ip, *address[1:])
        return _bind(self, address)

    _socket.socket.bind = _pod_bind
'''


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc  # killed by signal N -> 128 + N, as a runtime reports


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass
class Probe:
    kind: str  # startup | liveness | readiness
    spec: dict
    next_due: float
    successes: int = 0
    failures: int = 0


@dataclass
class Ctr:
    """Runtime facts of one container of a pod."""

    spec: dict
    init: bool = False
    restart_count: int = 0
    crashes: int = 0
    proc: subprocess.Popen | None = None
    started_at: str = ""
    started_mono: float = 0.0
    ever_started: bool = False
    exit_code: int | None = None
    last_state: dict = field(default_factory=dict)
    state: dict = field(default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}})
    next_start: float = 0.0
    ready: bool = False
    started: bool = False
    probes: list[Probe] = field(default_factory=list)
    kill_deadline: float | None = None
    kill_reason: str = ""
    restart_after_kill: bool = True
    env: dict = field(default_factory=dict)
    container_id: str = ""

    @property
    def name(self) -> str:
        return self.spec["name"]

    @property
    def running(self) -> bool:
        return self.proc is not None


class Agent:
    """The kubelet of one process node. ``run()`` blocks until SIGTERM/SIGINT."""

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
        from kubernetes import client, config

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
        self.workers: dict[str, PodWorker] = {}
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
        from kubernetes.client.rest import ApiException

        try:
            resp = fn(*args, _preload_content=False, **kw)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        return json.loads(resp.data)

    def event(self, pod: dict, reason: str, message: str, type_: str = "Normal") -> None:
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
        with self.lock:
            if uid in self.ips:
                return self.ips[uid]
            used = set(self.ips.values())
            if wanted and wanted not in used and _in_cidr(wanted, self.pod_cidr):
                ip = wanted
            else:
                ip = podlogic.allocate_ip(self.pod_cidr, used, self.last_ip)
                self.last_ip = ip
            self.ips[uid] = ip
            return ip

    def alloc_gpus(self, key: str, count: int) -> list[int]:
        with self.lock:
            if key in self.gpus_used:
                return self.gpus_used[key]
            used = [i for v in self.gpus_used.values() for i in v]
            got = podlogic.allocate_gpus(count, self.gpu_total, used) if count else []
            self.gpus_used[key] = got
            return got

    def release(self, uid: str) -> None:
        with self.lock:
            self.ips.pop(uid, None)
            for k in [k for k in self.gpus_used if k.startswith(uid + "/")]:
                del self.gpus_used[k]

    # -- node ---------------------------------------------------------------------------------
    def _heartbeat_loop(self) -> None:
        last_status = 0.0
        while not self.stopping.is_set():
            try:
                self._renew_lease()
                if time.monotonic() - last_status > 10 or last_status == 0:
                    self._post_node_status()
                    last_status = time.monotonic()
            except Exception as e:
                log.warning("heartbeat failed: %s", e)
            self.stopping.wait(self.heartbeat_s)

    def _renew_lease(self) -> None:
        lease = self.get_json(self.coord.read_namespaced_lease, self.node, "kube-node-lease")
        spec = {
            "holderIdentity": self.node,
            "leaseDurationSeconds": self.lease_duration_s,
            "renewTime": now_micro(),
        }
        if lease is None:
            node = self.get_json(self.core.read_node, self.node) or {}
            owner = node.get("metadata", {})
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {
                    "name": self.node,
                    "namespace": "kube-node-lease",
                    "ownerReferences": [
                        {
                            "apiVersion": "v1",
                            "kind": "Node",
                            "name": self.node,
                            "uid": owner.get("uid", ""),
                        }
                    ],
                },
                "spec": spec,
            }
            self.coord.create_namespaced_lease("kube-node-lease", body)
        else:
            self.coord.patch_namespaced_lease(
                self.node,
                "kube-node-lease",
                {"spec": spec},
                _content_type="application/merge-patch+json",
            )

    def _post_node_status(self) -> None:
        t = now_iso()

        def cond(type_: str, status: str, reason: str, message: str) -> dict:
            return {
                "type": type_,
                "status": status,
                "reason": reason,
                "message": message,
                "lastHeartbeatTime": t,
                "lastTransitionTime": self.started,
            }

        status = {
            "conditions": [
                cond("MemoryPressure", "False", "KubeletHasSufficientMemory", "ok"),
                cond("DiskPressure", "False", "KubeletHasNoDiskPressure", "ok"),
                cond("PIDPressure", "False", "KubeletHasSufficientPID", "ok"),
                cond("Ready", "True", "KubeletReady", "testbed node agent is posting ready status"),
            ],
            "addresses": [
                {"type": "InternalIP", "address": HOST_IP},
                {"type": "Hostname", "address": self.node},
            ],
            "nodeInfo": {
                "architecture": "amd64",
                "operatingSystem": "linux",
                "osImage": "eaas testbed process node",
                "kernelVersion": os.uname().release,
                "kubeletVersion": "eaas-testbed-agent",
                "kubeProxyVersion": "",
                "containerRuntimeVersion": "process://local",
                "machineID": "",
                "systemUUID": "",
                "bootID": self.started,
            },
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
        }
        self.core.patch_node_status(
            self.node, {"status": status}, _content_type="application/merge-patch+json"
        )

    # -- pods ---------------------------------------------------------------------------------
    def _dispatch(self, pod: dict) -> None:
        uid = pod["metadata"]["uid"]
        with self.lock:
            w = self.workers.get(uid)
            if w is None:
                w = PodWorker(self, pod)
                self.workers[uid] = w
                w.start()
                return
        w.update(pod)

    def _gone(self, uid: str) -> None:
        with self.lock:
            w = self.workers.get(uid)
        if w is not None:
            w.mark_gone()

    def _watch_loop(self) -> None:
        from kubernetes import watch
        from kubernetes.client.rest import ApiException

        selector = f"spec.nodeName={self.node}"
        while not self.stopping.is_set():
            try:
                lst = self.get_json(self.core.list_pod_for_all_namespaces, field_selector=selector)
                assert lst is not None  # a list never 404s
                seen = set()
                for pod in lst.get("items", []):
                    seen.add(pod["metadata"]["uid"])
                    self._dispatch(pod)
                with self.lock:
                    stale = [u for u in self.workers if u not in seen]
                for u in stale:
                    self._gone(u)
                rv = lst["metadata"]["resourceVersion"]
                w = watch.Watch()
                self._watch = w
                for ev in w.stream(
                    self.core.list_pod_for_all_namespaces,
                    field_selector=selector,
                    resource_version=rv,
                    timeout_seconds=120,
                ):
                    if self.stopping.is_set():
                        w.stop()
                        break
                    obj = ev["raw_object"]
                    if ev["type"] == "ERROR":
                        break
                    if ev["type"] == "DELETED":
                        self._gone(obj["metadata"]["uid"])
                    elif ev["type"] in ("ADDED", "MODIFIED"):
                        self._dispatch(obj)
            except ApiException as e:
                if e.status != 410:
                    log.warning("pod watch: %s", e)
                    self.stopping.wait(1)
            except Exception as e:
                if self.stopping.is_set():
                    break
                log.warning("pod watch: %s", e)
                self.stopping.wait(1)

    def power_off(self) -> None:
        """Kill every container's process group now (SIGKILL); report nothing."""
        self.stopping.set()
        with self.lock:
            workers = list(self.workers.values())
        for w in workers:
            w.power_off()

    def run(self) -> None:
        node = self.get_json(self.core.read_node, self.node)
        if node is None:
            raise SystemExit(f"node {self.node} does not exist")
        self.pod_cidr = node["spec"]["podCIDR"]
        self.gpu_total = int(node["status"].get("allocatable", {}).get("nvidia.com/gpu", "0"))
        self.shim_dir.mkdir(parents=True, exist_ok=True)
        (self.shim_dir / "sitecustomize.py").write_text(SHIM)
        self.pods_dir.mkdir(parents=True, exist_ok=True)
        hb = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        hb.start()
        log.info(
            "node agent for %s up (podCIDR %s, %d GPUs)", self.node, self.pod_cidr, self.gpu_total
        )
        watcher = threading.Thread(target=self._watch_loop, name="pod-watch", daemon=True)
        watcher.start()
        self.stopping.wait()


def _in_cidr(ip: str, cidr: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(ip) in ipaddress.ip_network(cidr)
    except ValueError:
        return False


class PodWorker(threading.Thread):
    """Runs one pod until it is deleted. Spawns its containers itself, and lives as long as
    they do (PR_SET_PDEATHSIG follows the spawning thread)."""

    def __init__(self, agent: Agent, pod: dict):
        meta = pod["metadata"]
        super().__init__(name=f"pod-{meta['namespace']}/{meta['name']}", daemon=True)
        self.agent = agent
        self.pod = pod
        self.uid = meta["uid"]
        self.wake = threading.Event()
        self.gone = False
        self.off = False
        self.dir = agent.pods_dir / f"{meta['namespace']}_{meta['name']}_{self.uid[:8]}"
        spec = pod["spec"]
        old = {c["name"]: c for c in (pod.get("status") or {}).get("containerStatuses") or []}
        old.update(
            {c["name"]: c for c in (pod.get("status") or {}).get("initContainerStatuses") or []}
        )
        self.init_ctrs = [Ctr(spec=c, init=True) for c in spec.get("initContainers") or []]
        self.ctrs = [Ctr(spec=c) for c in spec["containers"]]
        for c in self.init_ctrs + self.ctrs:
            prev = old.get(c.name)
            if prev is not None and prev.get("containerID"):
                # resumed after an agent restart: the old process died with the old agent
                c.restart_count = prev.get("restartCount", 0) + 1
        self.pod_ip = ""
        self.config_error: str | None = None
        self.volumes: dict[str, dict] = {}  # name -> {"path", "kind", "ro", "files"}
        self.token_cache: dict[str, tuple[float, str]] = {}
        self.next_volume_sync = 0.0
        self.last_status: dict | None = None
        self.cond_times: dict[str, tuple[str, str]] = {}
        self.start_time = (pod.get("status") or {}).get("startTime") or now_iso()
        self.initialized = not self.init_ctrs

    # -- called from the watch thread ---------------------------------------------------------
    def update(self, pod: dict) -> None:
        self.pod = pod
        self.wake.set()

    def mark_gone(self) -> None:
        self.gone = True
        self.wake.set()

    def power_off(self) -> None:
        self.off = True
        for c in self.init_ctrs + self.ctrs:
            if c.proc is not None:
                _killpg(c.proc.pid, signal.SIGKILL)
        self.wake.set()

    # -- main loop ----------------------------------------------------------------------------
    def run(self) -> None:
        try:
            self._run()
        except Exception:
            log.exception("pod worker %s failed", self.name)
            for c in self.init_ctrs + self.ctrs:
                if c.proc is not None:
                    _killpg(c.proc.pid, signal.SIGKILL)
                    c.proc.wait()
        finally:
            with self.agent.lock:
                self.agent.workers.pop(self.uid, None)
            self.agent.release(self.uid)
            if not self.off:  # keep the logs (removed with the state dir at `down`)
                shutil.rmtree(self.dir / "volumes", ignore_errors=True)
                for f in self.dir.glob(".*"):
                    if f.is_file():
                        f.unlink(missing_ok=True)

    @property
    def meta(self) -> dict:
        return self.pod["metadata"]

    def _run(self) -> None:
        status = self.pod.get("status") or {}
        terminal = status.get("phase") in ("Succeeded", "Failed")
        if self.pod["spec"].get("hostNetwork"):
            self.pod_ip = HOST_IP
        else:
            self.pod_ip = self.agent.alloc_ip(self.uid, status.get("podIP"))
        self.dir.mkdir(parents=True, exist_ok=True)
        if not terminal:
            try:
                self._setup_volumes()
            except podlogic.PodConfigError as e:
                self.config_error = str(e)
                self.event("FailedMount", str(e), "Warning")
        while True:
            if self.off or self.agent.stopping.is_set():
                self._reap_all()
                return
            if self.gone:
                self._terminate(grace=2.0)
                return
            if self.meta.get("deletionTimestamp"):
                grace = self.meta.get("deletionGracePeriodSeconds")
                if grace is None:
                    grace = self.pod["spec"].get("terminationGracePeriodSeconds", 30)
                self._terminate(grace=float(grace))
                if not self.off:
                    self._finalize_delete()
                return
            if not terminal:
                self._step()
                self._maybe_sync_volumes()
                self._post_status()
            self.wake.wait(0.1)
            self.wake.clear()

    def event(self, reason: str, message: str, type_: str = "Normal") -> None:
        self.agent.event(self.pod, reason, message, type_)

    # -- volumes ------------------------------------------------------------------------------
    def _lookup(self, kind: str, name: str) -> dict[str, str] | None:
        ns = self.meta["namespace"]
        if kind == "configmap":
            cm = self.agent.get_json(self.agent.core.read_namespaced_config_map, name, ns)
            if cm is None:
                return None
            data = dict(cm.get("data") or {})
            for k, v in (cm.get("binaryData") or {}).items():
                data[k] = base64.b64decode(v).decode(errors="replace")
            return data
        sec = self.agent.get_json(self.agent.core.read_namespaced_secret, name, ns)
        if sec is None:
            return None
        return {
            k: base64.b64decode(v).decode(errors="replace")
            for k, v in (sec.get("data") or {}).items()
        }

    def _raw(self, kind: str, name: str) -> dict[str, bytes] | None:
        ns = self.meta["namespace"]
        if kind == "configmap":
            cm = self.agent.get_json(self.agent.core.read_namespaced_config_map, name, ns)
            if cm is None:
                return None
            out = {k: v.encode() for k, v in (cm.get("data") or {}).items()}
            out.update({k: base64.b64decode(v) for k, v in (cm.get("binaryData") or {}).items()})
            return out
        sec = self.agent.get_json(self.agent.core.read_namespaced_secret, name, ns)
        if sec is None:
            return None
        return {k: base64.b64decode(v) for k, v in (sec.get("data") or {}).items()}

    def _keyed(self, kind: str, src: dict, default_mode: int, what: str) -> dict:
        name = str(src.get("name") or src.get("secretName"))
        data = self._raw(kind, name)
        if data is None:
            if src.get("optional"):
                return {}
            raise podlogic.PodConfigError(f"{what}: {kind} {name!r} not found")
        mode = src.get("defaultMode", default_mode)
        items = src.get("items")
        if not items:
            return {k: (v, mode) for k, v in data.items()}
        out = {}
        for it in items:
            if it["key"] not in data:
                if src.get("optional"):
                    continue
                raise podlogic.PodConfigError(f"{what}: key {it['key']!r} not in {kind} {name!r}")
            out[it["path"]] = (data[it["key"]], it.get("mode", mode))
        return out

    def _downward(self, items: list, mode: int, what: str) -> dict:
        out = {}
        for it in items:
            if "fieldRef" in it:
                v = podlogic.field_ref(self.pod, it["fieldRef"]["fieldPath"], self.pod_ip, HOST_IP)
            elif "resourceFieldRef" in it:
                r = it["resourceFieldRef"]
                ctr = next(
                    (
                        c
                        for c in self.pod["spec"]["containers"]
                        if c["name"] == r.get("containerName")
                    ),
                    self.pod["spec"]["containers"][0],
                )
                v = podlogic.resource_field_ref(ctr, r["resource"], r.get("divisor"))
            else:
                raise podlogic.PodConfigError(f"{what}: downwardAPI item {sorted(it)} unsupported")
            out[it["path"]] = (v.encode(), it.get("mode", mode))
        return out

    def _token(self, sa: str, src: dict) -> bytes:
        exp = int(src.get("expirationSeconds", 3607))
        key = f"{sa}/{src.get('audience', '')}/{exp}"
        cached = self.token_cache.get(key)
        if cached and time.monotonic() < cached[0]:
            return cached[1].encode()
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "audiences": [src["audience"]] if src.get("audience") else [],
                "expirationSeconds": exp,
                "boundObjectRef": {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": self.meta["name"],
                    "uid": self.uid,
                },
            },
        }
        resp = self.agent.core.create_namespaced_service_account_token(
            sa, self.meta["namespace"], body, _preload_content=False
        )
        token = json.loads(resp.data)["status"]["token"]
        self.token_cache[key] = (time.monotonic() + 0.8 * exp, token)  # kubelet: refresh at 80%
        return token.encode()

    def _content(self, v: dict) -> dict | None:
        """Files of a content volume (relpath -> (bytes, mode)), or None if not one."""
        what = f"volume {v['name']!r}"
        if "configMap" in v:
            return self._keyed("configmap", v["configMap"], 0o644, what)
        if "secret" in v:
            return self._keyed("secret", v["secret"], 0o644, what)
        if "downwardAPI" in v:
            d = v["downwardAPI"]
            return self._downward(d.get("items") or [], d.get("defaultMode", 0o644), what)
        if "projected" in v:
            p = v["projected"]
            mode = p.get("defaultMode", 0o644)
            out: dict = {}
            sa = self.pod["spec"].get("serviceAccountName", "default")
            for src in p.get("sources") or []:
                if "configMap" in src:
                    out.update(
                        self._keyed(
                            "configmap", {"defaultMode": mode, **src["configMap"]}, mode, what
                        )
                    )
                elif "secret" in src:
                    out.update(
                        self._keyed("secret", {"defaultMode": mode, **src["secret"]}, mode, what)
                    )
                elif "downwardAPI" in src:
                    out.update(self._downward(src["downwardAPI"].get("items") or [], mode, what))
                elif "serviceAccountToken" in src:
                    t = src["serviceAccountToken"]
                    out[t["path"]] = (self._token(sa, t), mode)
                else:
                    raise podlogic.PodConfigError(
                        f"{what}: projected source {sorted(src)} unsupported"
                    )
            return out
        return None

    def _setup_volumes(self) -> None:
        vdir = self.dir / "volumes"
        for v in self.pod["spec"].get("volumes") or []:
            name = v["name"]
            files = self._content(v)
            if files is not None:
                path = vdir / name
                path.mkdir(parents=True, exist_ok=True)
                _atomic_write(path, files)
                self.volumes[name] = {"path": str(path), "ro": True, "files": files, "spec": v}
            elif "emptyDir" in v:
                path = vdir / name
                path.mkdir(parents=True, exist_ok=True)
                self.volumes[name] = {"path": str(path), "ro": False}
            elif "hostPath" in v:
                hp = v["hostPath"]
                p, typ = Path(hp["path"]), hp.get("type", "")
                if typ == "DirectoryOrCreate":
                    p.mkdir(parents=True, exist_ok=True)
                elif typ == "FileOrCreate":
                    p.parent.mkdir(parents=True, exist_ok=True)
                    p.touch(exist_ok=True)
                elif typ == "Directory" and not p.is_dir():
                    raise podlogic.PodConfigError(
                        f"volume {name!r}: hostPath {p} is not a directory"
                    )
                elif typ == "File" and not p.is_file():
                    raise podlogic.PodConfigError(f"volume {name!r}: hostPath {p} is not a file")
                self.volumes[name] = {"path": str(p), "ro": False}
            else:
                kinds = sorted(k for k in v if k != "name")
                raise podlogic.PodConfigError(
                    f"volume {name!r}: type {kinds} is not supported by the testbed node agent"
                )
        self.next_volume_sync = time.monotonic() + self._sync_period()

    def _sync_period(self) -> float:
        ann = (self.meta.get("annotations") or {}).get(VOLUME_SYNC_ANNOTATION)
        try:
            return float(ann) if ann is not None else self.agent.volume_sync_s
        except ValueError:
            return self.agent.volume_sync_s

    def _maybe_sync_volumes(self) -> None:
        if self.config_error or time.monotonic() < self.next_volume_sync:
            return
        self.next_volume_sync = time.monotonic() + self._sync_period()
        for v in self.volumes.values():
            if "files" not in v:
                continue
            try:
                files = self._content(v["spec"])
            except Exception as e:
                log.warning("%s: volume refresh failed: %s", self.name, e)
                continue
            if files is not None and files != v["files"]:
                _atomic_write(Path(v["path"]), files)
                v["files"] = files

    # -- containers ---------------------------------------------------------------------------
    def _base_env(self, c: Ctr) -> dict[str, str]:
        env = {k: os.environ[k] for k in IMAGE_ENV if k in os.environ}
        venv_bin = os.path.dirname(sys.executable)
        env["PATH"] = f"{venv_bin}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        env["HOSTNAME"] = self.pod["spec"].get("hostname") or self.meta["name"]
        env[STATE_MARKER] = str(self.agent.testbed_dir)
        env[POD_MARKER] = self.uid
        env[CONTAINER_MARKER] = self._container_key(c)
        port = str(self.agent.apiserver_port)
        env.update(
            {
                "KUBERNETES_SERVICE_HOST": HOST_IP,
                "KUBERNETES_SERVICE_PORT": port,
                "KUBERNETES_SERVICE_PORT_HTTPS": port,
                "KUBERNETES_PORT": f"tcp://{HOST_IP}:{port}",
                "KUBERNETES_PORT_443_TCP": f"tcp://{HOST_IP}:{port}",
                "KUBERNETES_PORT_443_TCP_ADDR": HOST_IP,
                "KUBERNETES_PORT_443_TCP_PORT": port,
                "KUBERNETES_PORT_443_TCP_PROTO": "tcp",
            }
        )
        return env

    def _container_key(self, c: Ctr) -> str:
        return f"{self.uid}/{c.name}/{c.restart_count}"

    def _mounts(self, c: Ctr, env: dict) -> list[dict]:
        mounts = []
        for m in c.spec.get("volumeMounts") or []:
            v = self.volumes.get(m["name"])
            if v is None:
                raise podlogic.PodConfigError(f"volumeMount {m['name']!r}: no such volume")
            src = v["path"]
            sub = m.get("subPath") or podlogic.expand(m.get("subPathExpr", ""), env)
            if sub:
                src = os.path.join(src, sub)
                if not os.path.exists(src) and not v["ro"]:
                    os.makedirs(src, exist_ok=True)
            mounts.append(
                {"src": src, "dst": m["mountPath"], "ro": v["ro"] or bool(m.get("readOnly"))}
            )
            top = "/" + m["mountPath"].strip("/").split("/")[0]
            if not os.path.lexists(top):
                # a new top-level folder cannot be overlaid; create it (removed at `down`)
                os.makedirs(top, exist_ok=True)
                with open(self.agent.state_dir.parent / "host-dirs", "a") as f:  # <state>/nodes/
                    f.write(top + "\n")
        return mounts

    def _start(self, c: Ctr) -> None:
        spec = c.spec
        try:
            if self.config_error:
                raise podlogic.PodConfigError(self.config_error)
            env = podlogic.container_env(
                self.pod, spec, self.pod_ip, HOST_IP, self._base_env(c), self._lookup
            )
            argv = podlogic.command_line(spec, env)
            if not self.pod["spec"].get("hostNetwork"):
                env["EAAS_TESTBED_POD_IP"] = self.pod_ip
                pp = env.get("PYTHONPATH")
                env["PYTHONPATH"] = (
                    f"{pp}:{self.agent.shim_dir}" if pp else str(self.agent.shim_dir)
                )
            if self.agent.gpu_total:
                gpus = self.agent.alloc_gpus(f"{self.uid}/{c.name}", podlogic.gpu_request(spec))
                env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
                env["NVIDIA_VISIBLE_DEVICES"] = ",".join(map(str, gpus)) or "void"
            mounts = self._mounts(c, env)
            for p in (
                spec.get("startupProbe"),
                spec.get("livenessProbe"),
                spec.get("readinessProbe"),
            ):
                if p and not any(k in p for k in ("httpGet", "tcpSocket", "exec")):
                    raise podlogic.PodConfigError(
                        f"container {c.name!r}: probe kind {sorted(p)} is not supported"
                    )
        except (podlogic.PodConfigError, RuntimeError) as e:
            msg = str(e)
            if c.state.get("waiting", {}).get("message") != msg:
                self.event("Failed", f"Error: {msg}", "Warning")
            c.state = {"waiting": {"reason": "CreateContainerConfigError", "message": msg}}
            c.next_start = time.monotonic() + 2.0
            return
        n = c.restart_count
        ispec = {
            "argv": argv,
            "env": env,
            "cwd": spec.get("workingDir") or "/",
            "mounts": mounts,
            "scratch": str(self.dir / f".scratch-{c.name}"),
            "agent_pid": os.getpid(),
        }
        spec_path = self.dir / f".{c.name}-{n}.json"
        spec_path.write_text(json.dumps(ispec))
        logf = open(self.dir / f"{c.name}-{n}.log", "ab")
        try:
            c.proc = subprocess.Popen(
                [sys.executable, "-I", PODINIT, str(spec_path)],
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
                cwd="/",
                env={"PATH": env["PATH"]},
            )
        finally:
            logf.close()
        c.env = env
        c.container_id = f"process://{self.uid[:8]}-{c.name}-{n}-{c.proc.pid}"
        c.started_at = now_iso()
        c.started_mono = time.monotonic()
        c.ever_started = True
        c.exit_code = None
        c.state = {"running": {"startedAt": c.started_at}}
        c.ready = False
        c.kill_deadline = None
        c.restart_after_kill = True
        now = time.monotonic()
        c.probes = [
            Probe(kind, podlogic.probe_settings(spec[key]), now)
            for kind, key in (
                ("startup", "startupProbe"),
                ("liveness", "livenessProbe"),
                ("readiness", "readinessProbe"),
            )
            if spec.get(key) and not c.init
        ]
        for p in c.probes:
            p.next_due = now + p.spec["initialDelaySeconds"]
        c.started = not any(p.kind == "startup" for p in c.probes)
        self.event("Started", f"Started container {c.name} (pid {c.proc.pid})")

    def _kill(self, c: Ctr, grace: float, reason: str, restart: bool = True) -> None:
        if c.proc is None or c.kill_deadline is not None:
            return
        _killpg(c.proc.pid, signal.SIGTERM)
        c.kill_deadline = time.monotonic() + grace
        c.kill_reason = reason
        c.restart_after_kill = restart
        self.event("Killing", f"Stopping container {c.name}: {reason}")

    def _poll(self, c: Ctr, policy: str) -> None:
        if c.proc is None:
            return
        if c.kill_deadline is not None and time.monotonic() > c.kill_deadline:
            _killpg(c.proc.pid, signal.SIGKILL)
        rc = c.proc.poll()
        if rc is None:
            return
        _killpg(c.proc.pid, signal.SIGKILL)  # whatever it left in its process group
        kill_marked(CONTAINER_MARKER, self._container_key(c))  # ... or outside it
        code = _exit_code(rc)
        finished = now_iso()
        term = {
            "exitCode": code,
            "reason": "Completed" if code == 0 else "Error",
            "startedAt": c.started_at,
            "finishedAt": finished,
            "containerID": c.container_id,
        }
        ran = time.monotonic() - c.started_mono
        c.proc = None
        c.exit_code = code
        c.ready = False
        c.started = False
        killed = c.kill_deadline is not None
        c.kill_deadline = None
        restart = (
            c.restart_after_kill and policy != "Never"
            if killed
            else podlogic.should_restart(policy, code)
        )
        if c.init and code == 0:
            restart = False
        if restart:
            c.crashes = 0 if ran > BACKOFF_RESET_S else c.crashes + 1
            delay = podlogic.backoff_s(c.crashes - 1, self.agent.restart_backoff_s, MAX_BACKOFF_S)
            c.next_start = time.monotonic() + delay
            c.last_state = {"terminated": term}
            c.state = {
                "waiting": {
                    "reason": "CrashLoopBackOff",
                    "message": f"back-off {delay:g}s restarting failed container={c.name} pod={self.meta['name']}",
                }
            }
            c.restart_count += 1
        else:
            c.state = {"terminated": term}
            c.next_start = float("inf")

    def _run_probe(self, c: Ctr, p: Probe) -> tuple[bool, str]:
        s = p.spec
        timeout = float(s["timeoutSeconds"])
        try:
            if "httpGet" in s:
                h = s["httpGet"]
                host = h.get("host") or self.pod_ip
                port = podlogic.resolve_port(c.spec, h["port"])
                if h.get("scheme", "HTTP").upper() == "HTTPS":
                    ctx = ssl._create_unverified_context()
                    conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                        host, port, timeout=timeout, context=ctx
                    )
                else:
                    conn = http.client.HTTPConnection(host, port, timeout=timeout)
                try:
                    headers = {x["name"]: x["value"] for x in h.get("httpHeaders") or []}
                    headers.setdefault("User-Agent", "kube-probe/testbed")
                    conn.request("GET", h.get("path", "/"), headers=headers)
                    r = conn.getresponse()
                    r.read()
                    return 200 <= r.status < 400, f"HTTP probe failed with statuscode: {r.status}"
                finally:
                    conn.close()
            if "tcpSocket" in s:
                t = s["tcpSocket"]
                port = podlogic.resolve_port(c.spec, t["port"])
                with socket.create_connection(
                    (t.get("host") or self.pod_ip, port), timeout=timeout
                ):
                    return True, ""
            if "exec" in s:
                if c.proc is None:
                    return False, "container not running"
                ispec = {
                    "argv": s["exec"]["command"],
                    "env": c.env,
                    "cwd": c.spec.get("workingDir") or "/",
                    "mounts": [],
                    "enter_pid": c.proc.pid,
                    "agent_pid": os.getpid(),
                }
                path = self.dir / f".probe-{c.name}.json"
                path.write_text(json.dumps(ispec))
                done = subprocess.run(
                    [sys.executable, "-I", PODINIT, str(path)],
                    capture_output=True,
                    timeout=timeout + 1.0,  # + podinit start-up
                    env={"PATH": c.env.get("PATH", "/usr/bin:/bin")},
                )
                out = (done.stdout + done.stderr).decode(errors="replace")[-300:]
                return done.returncode == 0, f"exec probe exited {done.returncode}: {out}"
        except (OSError, subprocess.TimeoutExpired, http.client.HTTPException) as e:
            return False, f"{p.kind} probe failed: {e}"
        except podlogic.PodConfigError as e:
            return False, str(e)
        return False, "unsupported probe"

    def _probe(self, c: Ctr) -> None:
        if c.proc is None or c.kill_deadline is not None:
            return
        now = time.monotonic()
        has_readiness = False
        for p in c.probes:
            if p.kind == "readiness":
                has_readiness = True
            if p.kind == "startup" and c.started:
                continue
            if p.kind != "startup" and not c.started:
                continue
            if now < p.next_due:
                continue
            ok, msg = self._run_probe(c, p)
            p.next_due = time.monotonic() + p.spec["periodSeconds"]
            if ok:
                p.successes += 1
                p.failures = 0
            else:
                p.failures += 1
                p.successes = 0
                self.event("Unhealthy", f"{p.kind.capitalize()} probe failed: {msg}", "Warning")
            if p.kind == "startup":
                if p.successes >= 1:
                    c.started = True
                elif p.failures >= p.spec["failureThreshold"]:
                    self._kill(c, self._grace(), "failed startup probe, will be restarted")
            elif p.kind == "liveness":
                if p.failures >= p.spec["failureThreshold"]:
                    self._kill(c, self._grace(), "failed liveness probe, will be restarted")
            elif p.kind == "readiness":
                if p.successes >= p.spec["successThreshold"]:
                    c.ready = True
                elif p.failures >= p.spec["failureThreshold"]:
                    c.ready = False
        if not has_readiness:
            c.ready = c.started and c.proc is not None

    def _grace(self) -> float:
        return float(self.pod["spec"].get("terminationGracePeriodSeconds", 30))

    def _step(self) -> None:
        policy = self.pod["spec"].get("restartPolicy", "Always")
        now = time.monotonic()
        if not self.initialized:
            for c in self.init_ctrs:
                if c.exit_code == 0 and c.proc is None:
                    continue
                self._poll(c, "OnFailure" if policy != "Never" else "Never")
                if c.proc is None and now >= c.next_start:
                    self._start(c)
                break
            self.initialized = all(c.exit_code == 0 and c.proc is None for c in self.init_ctrs)
            if not self.initialized:
                return
        for c in self.ctrs:
            self._poll(c, policy)
            if c.proc is None and now >= c.next_start:
                self._start(c)
            self._probe(c)

    def _reap_all(self) -> None:
        for c in self.init_ctrs + self.ctrs:
            if c.proc is not None:
                _killpg(c.proc.pid, signal.SIGKILL)
                c.proc.wait()
                c.proc = None
        kill_marked(POD_MARKER, self.uid)

    def _terminate(self, grace: float) -> None:
        running = [c for c in self.init_ctrs + self.ctrs if c.proc is not None]
        for c in running:
            c.kill_deadline = None
            self._kill(c, grace, "pod deleted", restart=False)
        while any(c.proc is not None for c in running):
            if self.off or self.agent.stopping.is_set():
                self._reap_all()
                return
            for c in running:
                self._poll(c, "Never")
            time.sleep(0.05)
        kill_marked(POD_MARKER, self.uid)
        if not self.gone:
            self._post_status()

    def _finalize_delete(self) -> None:
        from kubernetes.client.rest import ApiException

        try:
            self.agent.core.delete_namespaced_pod(
                self.meta["name"],
                self.meta["namespace"],
                body={"gracePeriodSeconds": 0, "preconditions": {"uid": self.uid}},
            )
        except ApiException as e:
            if e.status not in (404, 409):
                log.warning("%s: final delete failed: %s", self.name, e)

    # -- status -------------------------------------------------------------------------------
    def _ctr_status(self, c: Ctr) -> dict:
        st = {
            "name": c.name,
            "image": c.spec.get("image", ""),
            "imageID": "",
            "ready": c.ready,
            "started": c.started and c.proc is not None,
            "restartCount": c.restart_count,
            "state": c.state,
            "lastState": c.last_state,
        }
        if c.container_id:
            st["containerID"] = c.container_id
        return st

    def _cond(self, type_: str, ok: bool) -> dict:
        status = "True" if ok else "False"
        prev = self.cond_times.get(type_)
        if prev is None or prev[0] != status:
            self.cond_times[type_] = (status, now_iso())
        return {"type": type_, "status": status, "lastTransitionTime": self.cond_times[type_][1]}

    def _status(self) -> dict:
        policy = self.pod["spec"].get("restartPolicy", "Always")
        if not self.initialized:
            init_failed = policy == "Never" and any(
                "terminated" in c.state and c.exit_code not in (0, None) for c in self.init_ctrs
            )
            phase = "Failed" if init_failed else "Pending"
        else:
            phase = podlogic.pod_phase(
                policy,
                [
                    {
                        "started": c.ever_started,
                        "running": c.proc is not None,
                        "exit_code": c.exit_code,
                    }
                    for c in self.ctrs
                ],
            )
        containers_ready = self.initialized and all(
            c.ready and c.proc is not None for c in self.ctrs
        )
        existing = {c["type"]: c for c in (self.pod.get("status") or {}).get("conditions") or []}
        gates = [g["conditionType"] for g in self.pod["spec"].get("readinessGates") or []]
        gates_ok = all(existing.get(g, {}).get("status") == "True" for g in gates)
        conds = [
            self._cond("PodReadyToStartContainers", True),
            self._cond("Initialized", self.initialized),
            self._cond("ContainersReady", containers_ready),
            self._cond("Ready", containers_ready and gates_ok),
        ]
        # keep conditions owned by others (PodScheduled, readiness gates, DisruptionTarget)
        mine = {c["type"] for c in conds}
        conds += [c for t, c in existing.items() if t not in mine]
        status = {
            "phase": phase,
            "conditions": conds,
            "hostIP": HOST_IP,
            "hostIPs": [{"ip": HOST_IP}],
            "podIP": self.pod_ip,
            "podIPs": [{"ip": self.pod_ip}],
            "startTime": self.start_time,
            "containerStatuses": [self._ctr_status(c) for c in self.ctrs],
        }
        if self.init_ctrs:
            status["initContainerStatuses"] = [self._ctr_status(c) for c in self.init_ctrs]
        return status

    def _post_status(self) -> None:
        from kubernetes.client.rest import ApiException

        status = self._status()
        if status == self.last_status:
            return
        try:
            self.agent.core.patch_namespaced_pod_status(
                self.meta["name"],
                self.meta["namespace"],
                {"status": status},
                _content_type="application/merge-patch+json",
            )
            self.last_status = status
        except ApiException as e:
            if e.status == 404:
                self.gone = True
            else:
                log.warning("%s: status update failed: %s", self.name, e)


def _atomic_write(path: Path, files: dict[str, tuple[bytes, int]]) -> None:
    """Write ``files`` (relpath -> (content, mode)) into ``path`` the way the kubelet's
    AtomicWriter does: a fresh ``..<timestamp>`` folder, then one ``rename`` of the ``..data``
    symlink, with each top-level name a symlink into ``..data``; readers never see a mix."""
    ts = path / f"..{time.time_ns()}"
    ts.mkdir()
    for rel, (data, mode) in files.items():
        f = ts / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(data)
        f.chmod(mode)
    data_link = path / "..data"
    old = os.readlink(data_link) if data_link.is_symlink() else None
    tmp = path / "..data_tmp"
    if tmp.is_symlink():
        tmp.unlink()
    os.symlink(ts.name, tmp)
    os.replace(tmp, data_link)
    tops = {rel.split("/")[0] for rel in files}
    for top in tops:
        link = path / top
        if not link.is_symlink():
            os.symlink(f"..data/{top}", link)
    for entry in path.iterdir():
        if not entry.name.startswith("..") and entry.name not in tops and entry.is_symlink():
            entry.unlink()
    if old and old != ts.name:
        shutil.rmtree(path / old, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m eaas.testbed.agent", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--node", required=True)
    ap.add_argument("--kubeconfig", required=True)
    ap.add_argument("--state-dir", required=True, help="this node's folder (pods, logs, shim)")
    ap.add_argument("--apiserver-port", type=int, required=True)
    ap.add_argument("--restart-backoff-s", type=float, default=10.0)
    ap.add_argument("--volume-sync-s", type=float, default=60.0)
    ap.add_argument("--heartbeat-s", type=float, default=2.0)
    ap.add_argument("--lease-duration-s", type=int, default=40)
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(threadName)s %(message)s",
    )
    logging.getLogger("kubernetes").setLevel(logging.WARNING)
    logging.getLogger("urllib3").setLevel(logging.WARNING)
    agent = Agent(
        node=args.node,
        kubeconfig=args.kubeconfig,
        state_dir=Path(args.state_dir),
        apiserver_port=args.apiserver_port,
        restart_backoff_s=args.restart_backoff_s,
        volume_sync_s=args.volume_sync_s,
        heartbeat_s=args.heartbeat_s,
        lease_duration_s=args.lease_duration_s,
    )

    def stop(signum, frame):  # node power-off: containers die, nothing is reported
        log.info("signal %d: stopping node %s", signum, args.node)
        agent.power_off()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    agent.run()
    # give workers a moment to reap their processes
    deadline = time.monotonic() + 5
    while agent.workers and time.monotonic() < deadline:
        time.sleep(0.05)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
