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
  ``EAAS_TESTBED_POD_IP``): the testbed's stand-in for a pod network namespace; the same shim
  resolves Service names (``<svc>.<ns>.svc``) to the Service's Ready pods, port mapped to the
  ``targetPort`` (:mod:`.service_dns`): the stand-in for cluster DNS and kube-proxy;
* volumes (configMap, secret, projected incl. the service-account token from the TokenRequest
  API and ``kube-root-ca.crt``, downwardAPI, emptyDir, hostPath) appear at their
  ``mountPath`` in a private mount namespace per container (:mod:`.podinit`); configMap,
  secret, projected and downwardAPI contents are refreshed every ``--volume-sync-s`` seconds
  (default 60, like the kubelet's sync period; per pod: annotation
  ``testbed.eaas.io/volume-sync-seconds``), written atomically (``..data`` symlink swap);
* startup / liveness / readiness probes (httpGet, tcpSocket, exec) drive ``started``,
  restarts and the ``Ready``/``ContainersReady`` conditions; ``containerStatuses`` (state,
  lastState, exitCode, restartCount), init containers, ``phase``; ``restartPolicy`` with the
  kubelet's back-off (``--restart-backoff-s`` doubling to 300 s); a status someone else
  overwrote (the node-lifecycle controller's Ready=False on a node that was NotReady) is
  written back within ``REASSERT_MIN_S`` (1 s) of the watch delivering it
  (:func:`.pod.status_drift`), as a kubelet's status sync does;
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
import logging
import os
import signal
import threading
import time
from pathlib import Path

from kubernetes import watch
from kubernetes.client.rest import ApiException

from .node import HOST_IP, Node, now_iso, now_micro
from .pod_worker import PodWorker
from .service_dns import ServiceDNS

log = logging.getLogger("eaas.testbed.agent")

# sitecustomize for Python containers: wildcard binds go to the pod IP (see module doc).
SHIM = '''"""Testbed pod network stand-in: a wildcard bind binds the pod IP (EAAS_TESTBED_POD_IP);
Service names resolve to their Ready pods (service-hosts.json next to this file)."""
import json as _json
import os as _os
import socket as _socket

_HOSTS = _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "service-hosts.json")
_gai = _socket.getaddrinfo


def _service_gai(host, port, family=0, type=0, proto=0, flags=0):
    name = host.decode() if isinstance(host, bytes) else host
    if isinstance(name, str) and "." in name and not name[:1].isdigit() and ":" not in name:
        try:
            with open(_HOSTS) as f:
                eps = _json.load(f).get(name.rstrip(".").lower())
        except (OSError, ValueError):
            eps = None
        if eps is not None and family in (0, _socket.AF_INET):
            if not eps:
                raise _socket.gaierror(_socket.EAI_NONAME, "Service has no Ready pod: " + name)
            out = []
            for ep in eps:
                p = ep["ports"].get(str(port), port) if port is not None else 0
                out.append(
                    (
                        _socket.AF_INET,
                        type or _socket.SOCK_STREAM,
                        proto or _socket.IPPROTO_TCP,
                        "",
                        (ep["ip"], int(p)),
                    )
                )
            return out
    return _gai(host, port, family, type, proto, flags)


_socket.getaddrinfo = _service_gai

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


class Agent(Node):
    """The kubelet of one process node. ``run()`` blocks until SIGTERM/SIGINT."""

    def __init__(self, *args, **kw):
        """The arguments of :class:`.node.Node`."""
        super().__init__(*args, **kw)
        self.workers: dict[str, PodWorker] = {}  # pod uid -> its worker

    def release(self, uid: str) -> None:
        """Forget pod ``uid``: its worker, then its pod IP and GPUs."""
        with self.lock:
            self.workers.pop(uid, None)
        super().release(uid)

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
        ServiceDNS(self.core, self.shim_dir, self.stopping).start()
        self.pods_dir.mkdir(parents=True, exist_ok=True)
        hb = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        hb.start()
        log.info(
            "node agent for %s up (podCIDR %s, %d GPUs)", self.node, self.pod_cidr, self.gpu_total
        )
        watcher = threading.Thread(target=self._watch_loop, name="pod-watch", daemon=True)
        watcher.start()
        self.stopping.wait()


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
