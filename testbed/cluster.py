"""Start and stop the local Kubernetes testbed: a real control plane with process and kwok nodes.

What runs (all on 127.0.0.1, detached from the calling process, one log file each under
``<state-dir>/logs/``):

* etcd — the store.
* kube-apiserver — client-certificate auth, RBAC, default admission plugins, service-account
  token signing, ``--service-cluster-ip-range`` 10.96.0.0/16 (virtual; there is no kube-proxy),
  the aggregation layer (request-header CA and a front-proxy client certificate) for
  aggregated APIs such as the operator's ``external.metrics.k8s.io``.
* kube-controller-manager — Deployments/ReplicaSets, garbage collection of owned objects, the
  ``default`` ServiceAccount, node lifecycle (NotReady taints, eviction). Its node monitor is
  shortened (``--node-monitor-grace-period`` :data:`NODE_MONITOR_GRACE_S` s, period 2 s, the
  upstream defaults are 50 s / 5 s) so that a stopped node turns NotReady within seconds. The
  HorizontalPodAutoscaler controller syncs every :data:`HPA_SYNC_PERIOD_S` s (upstream 15 s).
* kube-scheduler — the real scheduler, so extended resources (``nvidia.com/gpu``,
  ``rdma/ib``), node selectors and affinity are enforced as in a real cluster.
* one node agent per *process node* (:mod:`.agent`): the node's kubelet. Pods bound to it run
  their containers' commands as local processes on the pod IP, with volumes, probes, restarts,
  termination and node Lease heartbeats. ``eaas testbed node stop|start NAME`` stops
  (power-off: its containers die) and restarts one agent.
* kwok — the kwok *controller* alone (not kwokctl), for *kwok nodes* (scale tests): it keeps
  those fake Node objects Ready (leases + status heartbeats) and moves pods bound to them to
  Running/Ready with pod IPs from the node's ``spec.podCIDR``, without running anything.
  Stages are the kwok defaults (``kwok-stages.yaml``). Docs: https://kwok.sigs.k8s.io/docs/
  (user/kwok-in-cluster, user/kwok-manage-nodes-and-pods, user/stages-configuration).

Every node ``i`` gets ``spec.podCIDR`` 127.<net>.<i>.0/24, so pod IPs are loopback addresses.
``net`` (1..254) is claimed per testbed (:func:`claim_pod_net`), so several testbeds on one
machine (parallel test runs) never hand out the same pod IP.
There is no container runtime and no image pull: a process node's single "image" is the local
``eaas`` install (see :mod:`.agent`).

State (``<state-dir>/testbed.json``): pids, ports, paths. ``down`` stops the node agents (and
with them every container), then the recorded processes (SIGTERM, then SIGKILL) and removes
the state dir. Default state dir: ``~/.cache/eaas/testbed/run``.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import binaries as _build
from . import pki as _pki

SERVICE_CIDR = "10.96.0.0/16"
SERVICE_IP = "10.96.0.1"  # first IP of SERVICE_CIDR: the in-cluster `kubernetes` Service
KWOK_ANNOTATION = "kwok.x-k8s.io/node"
GPU_LABELS = {"eaas.io/rdma": "true", "nvidia.com/gpu.present": "true", "eaas.io/node-kind": "gpu"}
CPU_LABELS = {"eaas.io/node-kind": "cpu"}
GPU_ALLOCATABLE = {
    "cpu": "96",
    "memory": "1Ti",
    "pods": "110",
    "nvidia.com/gpu": "8",
    "rdma/ib": "8",
    "ephemeral-storage": "1Ti",
}
CPU_ALLOCATABLE = {"cpu": "32", "memory": "128Gi", "pods": "110", "ephemeral-storage": "500Gi"}
PROCESS_LABEL = "eaas.io/testbed-node"  # "process" or "kwok"
NODE_MONITOR_GRACE_S = 20
#: kube-controller-manager --horizontal-pod-autoscaler-sync-period (s); upstream default 15.
HPA_SYNC_PERIOD_S = 3
STATE_FILE = "testbed.json"
# Start order; `down` stops in reverse.
COMPONENTS = ["etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok"]


class TestbedError(RuntimeError):
    """The testbed failed to start, or a component died; the message names the log file."""

    __test__ = False  # not a pytest test class


@dataclass
class Testbed:
    """A running testbed, as recorded in ``<state_dir>/testbed.json``."""

    __test__ = False

    state_dir: Path
    bin_dir: Path
    kubeconfig: Path
    apiserver_url: str
    ports: dict = field(default_factory=dict)
    pids: dict = field(default_factory=dict)
    gpu_nodes: list = field(default_factory=list)
    cpu_nodes: list = field(default_factory=list)
    #: nodes run by a node agent (pods really run); the rest are kwok nodes
    process_nodes: list = field(default_factory=list)
    #: node -> pid of its running agent
    agents: dict = field(default_factory=dict)
    #: node agent settings (restart_backoff_s, volume_sync_s), reused by ``node start``
    agent_settings: dict = field(default_factory=dict)
    #: second octet of the pod IPs (127.<pod_net>.<node>.<n>), unique among live testbeds
    pod_net: int = 1

    def env(self, base: dict | None = None) -> dict:
        """A copy of ``base`` (default ``os.environ``) with KUBECONFIG and PATH pointing here."""
        env = dict(os.environ if base is None else base)
        env["KUBECONFIG"] = str(self.kubeconfig)
        env["PATH"] = f"{self.bin_dir}{os.pathsep}{env.get('PATH', '')}"
        return env

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess:
        """Run this testbed's kubectl; returns the CompletedProcess (text mode)."""
        return subprocess.run(
            [str(self.bin_dir / "kubectl"), *args],
            env=self.env(),
            input=input,
            capture_output=True,
            text=True,
            check=check,
            timeout=timeout,
        )

    def to_json(self) -> dict:
        return {
            "state_dir": str(self.state_dir),
            "bin_dir": str(self.bin_dir),
            "kubeconfig": str(self.kubeconfig),
            "apiserver_url": self.apiserver_url,
            "ports": self.ports,
            "pids": self.pids,
            "gpu_nodes": self.gpu_nodes,
            "cpu_nodes": self.cpu_nodes,
            "process_nodes": self.process_nodes,
            "agents": self.agents,
            "agent_settings": self.agent_settings,
            "pod_net": self.pod_net,
        }

    @classmethod
    def from_json(cls, d: dict) -> Testbed:
        return cls(
            state_dir=Path(d["state_dir"]),
            bin_dir=Path(d["bin_dir"]),
            kubeconfig=Path(d["kubeconfig"]),
            apiserver_url=d["apiserver_url"],
            ports=d["ports"],
            pids=d["pids"],
            gpu_nodes=d.get("gpu_nodes", []),
            cpu_nodes=d.get("cpu_nodes", []),
            process_nodes=d.get("process_nodes", []),
            agents=d.get("agents", {}),
            agent_settings=d.get("agent_settings", {}),
            pod_net=d.get("pod_net", 1),
        )

    def save(self) -> None:
        (self.state_dir / STATE_FILE).write_text(json.dumps(self.to_json(), indent=2))


def _pod_net_dir() -> Path:
    return Path(tempfile.gettempdir()) / "eaas-testbed-pod-nets"


def _claim_alive(text: str) -> bool:
    """Whether a claim file's ``<pid> <state dir>`` still stands: its claimer runs, or the
    testbed recorded in that state dir has a live component."""
    pid, _, other = text.partition(" ")
    try:
        os.kill(int(pid), 0)
        return True
    except (ValueError, ProcessLookupError):
        pass
    except PermissionError:
        return True
    tb = load(Path(other)) if other else None
    return tb is not None and any(_pid_alive(p, n) for n, p in tb.pids.items())


def _nets_in_use() -> set[int]:
    """Second octets of 127.x.y.z addresses that local TCP sockets are bound to (testbeds that
    hold no claim: older versions, or a claim file removed by hand)."""
    used = set()
    for table in ("/proc/net/tcp",):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            ip_hex = line.split()[1].split(":")[0]
            ip = socket.inet_ntoa(int(ip_hex, 16).to_bytes(4, "little"))
            a, b, _, _ = ip.split(".")
            if a == "127" and ip != "127.0.0.1":
                used.add(int(b))
    return used


def claim_pod_net(state_dir: Path) -> int:
    """Claim the second octet ``net`` of this testbed's pod IPs (127.<net>.<node>.<n>): the
    lowest in 1..254 that no live testbed holds (claim files ``<tmp>/eaas-testbed-pod-nets/
    <net>`` holding ``<pid> <state dir>``, under an flock) and no local TCP socket is bound in.
    Released by :func:`down`.

    Raises:
        TestbedError: all 254 are taken.
    """
    import fcntl

    d = _pod_net_dir()
    d.mkdir(exist_ok=True)
    with open(d / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        busy = _nets_in_use()
        for net in range(1, 255):
            f = d / str(net)
            own = False
            if f.exists():
                text = f.read_text().strip()
                own = text.partition(" ")[2] == str(state_dir)
                if not own and _claim_alive(text):
                    continue
            if net in busy and not own:
                continue
            f.write_text(f"{os.getpid()} {state_dir}")
            return net
    raise TestbedError("no free pod network 127.<net>.0.0/16 (254 testbeds alive?)")


def release_pod_net(tb: Testbed) -> None:
    """Drop this testbed's claim on its pod network (if still its own)."""
    f = _pod_net_dir() / str(tb.pod_net)
    try:
        if f.read_text().strip().partition(" ")[2] == str(tb.state_dir):
            f.unlink()
    except OSError:
        pass


def default_state_dir() -> Path:
    """``~/.cache/eaas/testbed/run`` (or under ``$EAAS_CACHE_DIR``)."""
    return _build.cache_root() / "run"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pid_alive(pid: int, binary: str | None = None) -> bool:
    """True if ``pid`` runs and (when given) its executable is ``binary`` (guards pid reuse)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().split(")")[-1].split()[0] == "Z":  # zombie: our own dead child
                return False
        if binary is not None:
            exe = os.readlink(f"/proc/{pid}/exe")
            return os.path.basename(exe.removesuffix(" (deleted)")) == binary
    except OSError:
        pass
    return True


def load(state_dir: Path | None = None) -> Testbed | None:
    """The testbed recorded in ``state_dir``, or None if there is no record."""
    p = Path(state_dir or default_state_dir()) / STATE_FILE
    if not p.is_file():
        return None
    return Testbed.from_json(json.loads(p.read_text()))


def _ssl_context(pki_dir: Path) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki_dir / "ca.crt"))
    ctx.load_cert_chain(str(pki_dir / "admin.crt"), str(pki_dir / "admin.key"))
    return ctx


def api(
    tb: Testbed, method: str, path: str, body: dict | None = None, timeout: float = 10
) -> tuple[int, dict | str]:
    """One HTTPS request to the testbed apiserver as admin. Returns (status, parsed body)."""
    ctx = _ssl_context(tb.state_dir / "pki")
    conn = http.client.HTTPSConnection(
        "127.0.0.1", tb.ports["apiserver"], context=ctx, timeout=timeout
    )
    try:
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read().decode()
        try:
            return resp.status, json.loads(raw)
        except ValueError:
            return resp.status, raw
    finally:
        conn.close()


def healthy(tb: Testbed) -> bool:
    """All recorded processes alive and the apiserver answers ``/readyz`` with 200."""
    if not all(_pid_alive(pid, name) for name, pid in tb.pids.items()):
        return False
    try:
        status, _ = api(tb, "GET", "/readyz", timeout=5)
    except OSError:
        return False
    return status == 200


def _write_kubeconfig(path: Path, server: str, pki: dict) -> None:
    import base64

    def b64(p: Path) -> str:
        return base64.b64encode(p.read_bytes()).decode()

    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "eaas-testbed",
        "clusters": [
            {
                "name": "eaas-testbed",
                "cluster": {"server": server, "certificate-authority-data": b64(pki["ca_crt"])},
            }
        ],
        "users": [
            {
                "name": "eaas-testbed-admin",
                "user": {
                    "client-certificate-data": b64(pki["admin_crt"]),
                    "client-key-data": b64(pki["admin_key"]),
                },
            }
        ],
        "contexts": [
            {
                "name": "eaas-testbed",
                "context": {
                    "cluster": "eaas-testbed",
                    "user": "eaas-testbed-admin",
                    "namespace": "default",
                },
            }
        ],
        "preferences": {},
    }
    path.write_text(json.dumps(cfg, indent=2))  # JSON is valid YAML
    path.chmod(0o600)


def _die_with_parent() -> None:
    """preexec_fn: ask Linux to SIGKILL the child when the process that started it exits
    (prctl PR_SET_PDEATHSIG), so a killed pytest run leaves no control plane behind."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG


def _start(tb: Testbed, name: str, args: list[str], attached: bool = False) -> None:
    log = tb.state_dir / "logs" / f"{name}.log"
    with open(log, "ab") as f:
        proc = subprocess.Popen(
            [str(tb.bin_dir / name), *args],
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=tb.state_dir,
            start_new_session=True,
            close_fds=True,
            preexec_fn=_die_with_parent if attached else None,
        )
    tb.pids[name] = proc.pid
    (tb.state_dir / STATE_FILE).write_text(json.dumps(tb.to_json(), indent=2))


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _wait(tb: Testbed, what: str, check, deadline: float, watch: list[str]) -> None:
    while True:
        for name in watch:
            if not _pid_alive(tb.pids[name], name):
                log = tb.state_dir / "logs" / f"{name}.log"
                raise TestbedError(
                    f"{name} exited while waiting for {what}; log {log}:\n{_tail(log)}"
                )
        for node, pid in tb.agents.items():
            if not agent_alive(pid):
                log = tb.state_dir / "logs" / f"agent-{node}.log"
                raise TestbedError(
                    f"node agent of {node} exited while waiting for {what}; log {log}:\n"
                    f"{_tail(log)}"
                )
        try:
            if check():
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TestbedError(f"timed out waiting for {what}; logs in {tb.state_dir / 'logs'}")
        time.sleep(0.5)


def _https_ok(port: int, path: str, ctx: ssl.SSLContext) -> bool:
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=3)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        r.read()
        return r.status == 200
    finally:
        conn.close()


def _node(
    name: str, index: int, labels: dict, allocatable: dict, process: bool, net: int = 1
) -> dict:
    annotations = {"node.alpha.kubernetes.io/ttl": "0"}
    if not process:
        annotations[KWOK_ANNOTATION] = "fake"  # kwok manages this node and its pods
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": annotations,
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "process" if process else "kwok",
                PROCESS_LABEL: "process" if process else "kwok",
                **labels,
            },
        },
        # pod IPs come from spec.podCIDR: loopback addresses, one /24 per node.
        "spec": {"podCIDR": f"127.{net}.{index}.0/24", "podCIDRs": [f"127.{net}.{index}.0/24"]},
        "status": {"allocatable": dict(allocatable), "capacity": dict(allocatable)},
    }


def _check_mount_namespaces() -> None:
    """Process nodes give each container a private mount namespace (:mod:`.podinit`).

    Raises:
        TestbedError: this process may not create one (needs root / CAP_SYS_ADMIN).
    """
    probe = "import ctypes, sys; sys.exit(ctypes.CDLL(None).unshare(0x20000) != 0)"
    r = subprocess.run([sys.executable, "-I", "-c", probe], capture_output=True, timeout=60)
    if r.returncode != 0:
        raise TestbedError(
            "process nodes need mount namespaces (root or CAP_SYS_ADMIN) to show pods their "
            "volumes at their mountPath; run as root, or use --process-nodes none (kwok nodes)"
        )


def _process_node_names(spec: str | list | None, gpu: list[str], cpu: list[str]) -> list[str]:
    """``"all"`` (default), ``"none"``, or node names (list or comma-separated).

    Raises:
        ValueError: a name that is not one of the testbed's nodes.
    """
    if spec is None or spec == "all":
        return gpu + cpu
    if spec == "none" or spec == []:
        return []
    names = [n.strip() for n in spec.split(",")] if isinstance(spec, str) else list(spec)
    unknown = [n for n in names if n not in gpu + cpu]
    if unknown:
        raise ValueError(f"--process-nodes: unknown node(s) {unknown}; nodes are {gpu + cpu}")
    return names


def up(
    state_dir: Path | None = None,
    gpu_nodes: int = 4,
    cpu_nodes: int = 1,
    timeout: float = 300,
    echo=print,
    attached: bool = False,
    process_nodes: str | list | None = "all",
    restart_backoff_s: float = 10.0,
    volume_sync_s: float = 60.0,
) -> Testbed:
    """Build (if needed) and start the testbed; return it once nodes are Ready.

    Idempotent: if a healthy testbed is already recorded in ``state_dir`` it is returned as
    is (``echo`` says so). A stale record (some process dead) is cleaned up first.

    ``attached=False`` (the CLI) detaches the components: they outlive the caller until
    ``down``. ``attached=True`` (the pytest fixture) makes Linux kill them when the calling
    process dies, even by SIGKILL, so an aborted test run leaks nothing.

    Node names: ``gpu-node-<i>`` (``nvidia.com/gpu: 8``, ``rdma/ib: 8``, labels
    ``eaas.io/rdma=true``, ``nvidia.com/gpu.present=true``) and ``cpu-node-<i>`` (no GPU/RDMA).
    ``process_nodes`` picks which of them run their pods for real through a node agent
    (``"all"``, ``"none"`` or names; label ``eaas.io/testbed-node=process``); the others are
    kwok nodes (``eaas.io/testbed-node=kwok``): pods there turn Ready without running.
    ``restart_backoff_s`` (crash-loop back-off base, doubling to 300 s) and ``volume_sync_s``
    (configMap/secret volume refresh delay) go to the node agents.

    Raises:
        TestbedError: a component exited or did not become ready within ``timeout`` seconds
            (everything started is stopped again).
        build.BuildError: building the binaries failed.
    """
    state_dir = Path(state_dir or default_state_dir()).absolute()
    old = load(state_dir)
    if old is not None:
        if healthy(old):
            echo(f"testbed already up (state {state_dir}, apiserver {old.apiserver_url})")
            return old
        echo(f"found a stale testbed record in {state_dir}; cleaning up")
        down(state_dir, echo=lambda *_: None)
    if gpu_nodes + cpu_nodes < 1:
        raise ValueError("need at least one node")
    gpu_names = [f"gpu-node-{i}" for i in range(gpu_nodes)]
    cpu_names = [f"cpu-node-{i}" for i in range(cpu_nodes)]
    proc_names = _process_node_names(process_nodes, gpu_names, cpu_names)
    if proc_names:
        _check_mount_namespaces()
    bin_dir = _build.build(echo=echo)
    t0 = time.monotonic()
    deadline = t0 + timeout
    if state_dir.exists() and any(state_dir.iterdir()):
        raise TestbedError(
            f"state dir {state_dir} exists and is not empty; remove it or pick another --state-dir"
        )
    (state_dir / "logs").mkdir(parents=True, exist_ok=True)
    (state_dir / "etcd").mkdir(mode=0o700, exist_ok=True)
    pki_dir = state_dir / "pki"
    pki = _pki.make_pki(pki_dir, SERVICE_IP)
    ports = {
        "etcd": _free_port(),
        "etcd_peer": _free_port(),
        "apiserver": _free_port(),
        "controller_manager": _free_port(),
        "scheduler": _free_port(),
    }
    url = f"https://127.0.0.1:{ports['apiserver']}"
    kubeconfig = state_dir / "kubeconfig"
    _write_kubeconfig(kubeconfig, url, pki)
    tb = Testbed(
        state_dir=state_dir, bin_dir=bin_dir, kubeconfig=kubeconfig, apiserver_url=url, ports=ports
    )
    tb.gpu_nodes, tb.cpu_nodes, tb.process_nodes = gpu_names, cpu_names, proc_names
    tb.agent_settings = {"restart_backoff_s": restart_backoff_s, "volume_sync_s": volume_sync_s}
    tb.pod_net = claim_pod_net(state_dir)
    try:
        _up(tb, pki, deadline, echo, attached)
    except BaseException:
        down(state_dir, echo=lambda *_: None, remove=False)
        raise
    echo(
        f"testbed up in {time.monotonic() - t0:.1f}s: {url}; "
        f"{gpu_nodes} GPU + {cpu_nodes} CPU nodes ({len(proc_names)} run processes); "
        f"state {state_dir}"
    )
    return tb


def _up(tb: Testbed, pki: dict, deadline: float, echo, attached: bool) -> None:
    ports = tb.ports
    etcd_url = f"http://127.0.0.1:{ports['etcd']}"
    peer_url = f"http://127.0.0.1:{ports['etcd_peer']}"
    echo("starting etcd")
    _start(
        tb,
        "etcd",
        [
            "--name=testbed",
            f"--data-dir={tb.state_dir / 'etcd'}",
            f"--listen-client-urls={etcd_url}",
            f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=testbed={peer_url}",
            "--initial-cluster-state=new",
            "--unsafe-no-fsync=true",
            "--log-level=warn",
            "--quota-backend-bytes=2147483648",
        ],
        attached=attached,
    )

    def etcd_ok() -> bool:
        conn = http.client.HTTPConnection("127.0.0.1", ports["etcd"], timeout=3)
        try:
            conn.request("GET", "/health")
            r = conn.getresponse()
            return r.status == 200 and b'"true"' in r.read()
        finally:
            conn.close()

    _wait(tb, "etcd /health", etcd_ok, deadline, ["etcd"])
    echo("starting kube-apiserver")
    _start(
        tb,
        "kube-apiserver",
        [
            f"--etcd-servers={etcd_url}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={ports['apiserver']}",
            f"--tls-cert-file={pki['apiserver_crt']}",
            f"--tls-private-key-file={pki['apiserver_key']}",
            f"--client-ca-file={pki['ca_crt']}",
            # Fills kube-system/extension-apiserver-authentication completely, so the delegated
            # authn of the controller-manager and scheduler does not log missing-CA errors.
            f"--requestheader-client-ca-file={pki['ca_crt']}",
            "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            # aggregation layer: the client certificate the apiserver proxies to aggregated API
            # servers with (the operator's external.metrics.k8s.io). No
            # --enable-aggregator-routing: it routes to EndpointSlice addresses, which may not
            # be loopback (every pod IP here is), so APIServices here point at ExternalName
            # Services (127.0.0.1 / a pod IP), which the default ClusterIP routing resolves.
            f"--proxy-client-cert-file={pki['front_proxy_client_crt']}",
            f"--proxy-client-key-file={pki['front_proxy_client_key']}",
            "--authorization-mode=RBAC",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki['sa_pub']}",
            f"--service-account-signing-key-file={pki['sa_key']}",
            "--allow-privileged=true",
            # Endpoints of the `kubernetes` Service may not hold loopback IPs (validation), so the
            # default lease reconciler would log an error every 10s; there is nothing to reach it.
            "--endpoint-reconciler-type=none",
            "--profiling=false",
            "--v=1",
        ],
        attached=attached,
    )
    ctx = _ssl_context(tb.state_dir / "pki")
    _wait(
        tb,
        "kube-apiserver /readyz",
        lambda: _https_ok(ports["apiserver"], "/readyz", ctx),
        deadline,
        ["etcd", "kube-apiserver"],
    )
    kc = str(tb.kubeconfig)
    echo("starting kube-controller-manager, kube-scheduler, kwok")
    _start(
        tb,
        "kube-controller-manager",
        [
            f"--kubeconfig={kc}",
            f"--authentication-kubeconfig={kc}",
            f"--authorization-kubeconfig={kc}",
            "--bind-address=127.0.0.1",
            f"--secure-port={ports['controller_manager']}",
            "--leader-elect=false",
            f"--service-account-private-key-file={pki['sa_key']}",
            f"--root-ca-file={pki['ca_crt']}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--controllers=*",
            f"--node-monitor-grace-period={NODE_MONITOR_GRACE_S}s",
            "--node-monitor-period=2s",
            # the real HPA controller, syncing every few seconds (upstream default 15 s)
            f"--horizontal-pod-autoscaler-sync-period={HPA_SYNC_PERIOD_S}s",
            "--profiling=false",
            "--v=1",
        ],
        attached=attached,
    )
    _start(
        tb,
        "kube-scheduler",
        [
            f"--kubeconfig={kc}",
            f"--authentication-kubeconfig={kc}",
            f"--authorization-kubeconfig={kc}",
            "--bind-address=127.0.0.1",
            f"--secure-port={ports['scheduler']}",
            "--leader-elect=false",
            "--profiling=false",
            "--v=1",
        ],
        attached=attached,
    )
    stages = Path(__file__).with_name("kwok-stages.yaml")
    _start(
        tb,
        "kwok",
        [
            f"--kubeconfig={kc}",
            f"--config={stages}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION}=fake",
            "--node-ip=127.0.0.1",
            f"--cidr=127.{tb.pod_net}.255.0/24",
            # kwok renews its leases every quarter of this (2.5 s; measured gaps up to 10 s on a
            # loaded machine), well inside the node monitor's grace
            "--node-lease-duration-seconds=10",
        ],
        attached=attached,
    )
    # Nodes: created by us, kept alive by kwok or by their node agent.
    proc = set(tb.process_nodes)
    nodes = [
        _node(n, i, GPU_LABELS, GPU_ALLOCATABLE, n in proc, tb.pod_net)
        for i, n in enumerate(tb.gpu_nodes)
    ]
    nodes += [
        _node(n, len(tb.gpu_nodes) + i, CPU_LABELS, CPU_ALLOCATABLE, n in proc, tb.pod_net)
        for i, n in enumerate(tb.cpu_nodes)
    ]
    for node in nodes:
        status, body = api(tb, "POST", "/api/v1/nodes", node)
        if status not in (200, 201):
            raise TestbedError(f"creating node {node['metadata']['name']} failed: {status} {body}")
    for name in tb.process_nodes:
        start_agent(tb, name, attached=attached)
    all_components = list(tb.pids)
    insecure = ssl.create_default_context()
    insecure.check_hostname = False
    insecure.verify_mode = ssl.CERT_NONE  # self-signed serving certs of KCM/scheduler
    _wait(
        tb,
        "kube-controller-manager /healthz",
        lambda: _https_ok(ports["controller_manager"], "/healthz", insecure),
        deadline,
        all_components,
    )
    _wait(
        tb,
        "kube-scheduler /readyz",
        lambda: _https_ok(ports["scheduler"], "/readyz", insecure),
        deadline,
        all_components,
    )
    names = {n["metadata"]["name"] for n in nodes}

    def nodes_ready() -> bool:
        status, body = api(tb, "GET", "/api/v1/nodes")
        if status != 200 or not isinstance(body, dict):
            return False
        ready = set()
        for n in body.get("items", []):
            conds = {c["type"]: c["status"] for c in n.get("status", {}).get("conditions", [])}
            taints = {t["key"] for t in n.get("spec", {}).get("taints", []) or []}
            # node lifecycle taints (not-ready / unreachable) must be gone as well
            if conds.get("Ready") == "True" and not any(
                t.startswith("node.kubernetes.io/") for t in taints
            ):
                ready.add(n["metadata"]["name"])
        return names <= ready

    _wait(tb, f"{len(names)} nodes Ready", nodes_ready, deadline, all_components)
    # The ServiceAccount admission plugin rejects pods until the `default` SA exists.
    _wait(
        tb,
        "ServiceAccount default/default",
        lambda: api(tb, "GET", "/api/v1/namespaces/default/serviceaccounts/default")[0] == 200,
        deadline,
        all_components,
    )
    (tb.state_dir / STATE_FILE).write_text(json.dumps(tb.to_json(), indent=2))


# ---------------------------------------------------------------------------------------------
# node agents (process nodes)
# ---------------------------------------------------------------------------------------------
#: Environment markers the node agent puts into every container's processes (inherited by
#: whatever they start), so that escaped descendants can be found: the testbed's stand-in for
#: the cgroups a kubelet would kill.
STATE_MARKER = "EAAS_TESTBED_STATE"
POD_MARKER = "EAAS_TESTBED_POD_UID"
CONTAINER_MARKER = "EAAS_TESTBED_CONTAINER"


def find_marked(name: str, value: str) -> list[int]:
    """Pids of the processes whose environment has ``name=value`` (from ``/proc/<pid>/environ``;
    the environment a process started with)."""
    needle = f"{name}={value}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return found


def kill_marked(name: str, value: str) -> list[int]:
    """SIGKILL every process marked ``name=value`` (see :func:`find_marked`); returns them."""
    pids = [p for p in find_marked(name, value) if p != os.getpid()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def agent_alive(pid: int) -> bool:
    """True if ``pid`` runs a node agent (guards pid reuse by checking its command line)."""
    if not _pid_alive(pid):
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"eaas.testbed.agent" in f.read()
    except OSError:
        return False


def start_agent(tb: Testbed, node: str, attached: bool = False) -> int:
    """Start the node agent of process node ``node``; record and return its pid.

    ``attached``: the agent dies with the calling process (PR_SET_PDEATHSIG), as for ``up``.
    """
    node_dir = tb.state_dir / "nodes" / node
    node_dir.mkdir(parents=True, exist_ok=True)
    settings = tb.agent_settings
    log = tb.state_dir / "logs" / f"agent-{node}.log"
    with open(log, "ab") as f:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "eaas.testbed.agent",
                f"--node={node}",
                f"--kubeconfig={tb.kubeconfig}",
                f"--state-dir={node_dir}",
                f"--apiserver-port={tb.ports['apiserver']}",
                f"--restart-backoff-s={settings.get('restart_backoff_s', 10.0)}",
                f"--volume-sync-s={settings.get('volume_sync_s', 60.0)}",
            ],
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=tb.state_dir,
            start_new_session=True,
            close_fds=True,
            preexec_fn=_die_with_parent if attached else None,
        )
    tb.agents[node] = proc.pid
    tb.save()
    return proc.pid


def stop_agent(tb: Testbed, node: str, timeout: float = 15) -> bool:
    """Stop the node agent of ``node`` (SIGTERM: it SIGKILLs its containers' process groups
    and exits without reporting, like a node losing power; SIGKILL after ``timeout`` s).
    Returns False if it was not running."""
    pid = tb.agents.pop(node, None)
    tb.save()
    if not pid or not agent_alive(pid):
        return False
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    end = time.monotonic() + timeout
    while agent_alive(pid) and time.monotonic() < end:
        _reap(pid)
        time.sleep(0.05)
    if agent_alive(pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _reap(pid)
    return True


def node_stop(name: str, state_dir: Path | None = None) -> None:
    """``eaas testbed node stop NAME``: power off process node ``name`` (its agent and every
    container on it stop; heartbeats stop, so the node-lifecycle controller marks it NotReady
    after ``NODE_MONITOR_GRACE_S`` s).

    Raises:
        TestbedError: no testbed, or ``name`` is not a process node.
    """
    tb = _require(state_dir)
    if name not in tb.process_nodes:
        raise TestbedError(f"{name} is not a process node (process nodes: {tb.process_nodes})")
    stop_agent(tb, name)


def node_start(name: str, state_dir: Path | None = None) -> None:
    """``eaas testbed node start NAME``: start the agent of process node ``name`` again (its
    pods' containers start again, counted as restarts; the node turns Ready).

    Raises:
        TestbedError: no testbed, ``name`` is not a process node, or its agent already runs.
    """
    tb = _require(state_dir)
    if name not in tb.process_nodes:
        raise TestbedError(f"{name} is not a process node (process nodes: {tb.process_nodes})")
    pid = tb.agents.get(name)
    if pid and agent_alive(pid):
        raise TestbedError(f"node {name} is already running (agent pid {pid})")
    start_agent(tb, name)


def _require(state_dir: Path | None) -> Testbed:
    tb = load(state_dir)
    if tb is None:
        raise TestbedError(
            f"no testbed in {state_dir or default_state_dir()}; run `eaas testbed up` first"
        )
    return tb


def down(
    state_dir: Path | None = None, echo=print, remove: bool = True, timeout: float = 15
) -> bool:
    """Stop every recorded component, in reverse start order (SIGTERM, then SIGKILL after
    ``timeout`` s each).

    Removes the state dir when ``remove`` (only a dir holding a testbed record, or one that
    ``up`` created). Returns False if nothing was recorded there.
    """
    state_dir = Path(state_dir or default_state_dir()).absolute()
    tb = load(state_dir)
    if tb is None:
        echo(f"no testbed recorded in {state_dir}")
        return False
    # Node agents first: each takes its containers down with it; then anything a container
    # started that escaped its process group (setsid, double fork).
    for node in list(tb.agents):
        stop_agent(tb, node)
    kill_marked(STATE_MARKER, str(state_dir))
    # One at a time, clients first, so that the apiserver can still reach etcd while it
    # shuts down (and nothing logs a storm of connection errors).
    for name in reversed(COMPONENTS):
        pid = tb.pids.get(name)
        if not pid or not _pid_alive(pid, name):
            continue
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            continue
        end = time.monotonic() + timeout
        while _pid_alive(pid, name) and time.monotonic() < end:
            _reap(pid)
            time.sleep(0.05)
        if _pid_alive(pid, name):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            time.sleep(0.1)
        _reap(pid)
    # top-level mount points the agents had to create on the host (e.g. /models), if empty
    host_dirs = state_dir / "nodes" / "host-dirs"
    if host_dirs.is_file():
        for d in sorted(set(host_dirs.read_text().split())):
            try:
                os.rmdir(d)
            except OSError:
                pass
    release_pod_net(tb)
    if remove:
        shutil.rmtree(state_dir, ignore_errors=True)
    echo(f"testbed stopped (state {state_dir}{' removed' if remove else ''})")
    return True


def _reap(pid: int) -> None:
    """Collect the exit status if ``pid`` is our child (tests start it in-process)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def env_lines(state_dir: Path | None = None) -> str:
    """Shell lines exporting KUBECONFIG and PATH for the testbed in ``state_dir``.

    Raises:
        TestbedError: no testbed is recorded there.
    """
    tb = load(state_dir)
    if tb is None:
        raise TestbedError(
            f"no testbed in {state_dir or default_state_dir()}; run `eaas testbed up` first"
        )
    import shlex

    return (
        f"export KUBECONFIG={shlex.quote(str(tb.kubeconfig))}\n"
        f'export PATH={shlex.quote(str(tb.bin_dir))}:"$PATH"\n'
    )
