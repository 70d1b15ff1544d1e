"""The control plane of the testbed: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler and the kwok controller as local processes on 127.0.0.1 (one log file each
under ``<state-dir>/logs/``), started in order and waited for, stopped in reverse."""

from __future__ import annotations

import functools
import http.client
import ssl
import time
from collections.abc import Callable
from pathlib import Path

from .nodes import KWOK_ANNOTATION
from .procs import agent_alive, pid_alive, spawn, tail, terminate
from .record import Testbed, TestbedError, ssl_context

SERVICE_CIDR = "10.96.0.0/16"
SERVICE_IP = "10.96.0.1"  # first IP of SERVICE_CIDR: the in-cluster `kubernetes` Service
NODE_MONITOR_GRACE_S = 20
#: kube-controller-manager --horizontal-pod-autoscaler-sync-period (s); upstream default 15.
HPA_SYNC_PERIOD_S = 3
# Start order; `down` stops in reverse.
COMPONENTS = ["etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok"]


def start_component(tb: Testbed, name: str, args: list[str], attached: bool = False) -> None:
    """Start control-plane binary ``name`` of ``tb.bin_dir`` with ``args``; record its pid.

    ``attached``: it dies with the calling process (PR_SET_PDEATHSIG).
    """
    log = tb.state_dir / "logs" / f"{name}.log"
    tb.pids[name] = spawn([str(tb.bin_dir / name), *args], log, tb.state_dir, attached)
    tb.save()


def wait_for(
    tb: Testbed, what: str, check: Callable[[], bool], deadline: float, watch: list[str]
) -> None:
    """Poll ``check()`` every 0.5 s until it is true (an OSError counts as not yet).

    Raises:
        TestbedError: a component of ``watch`` or a node agent exited (the message ends with
            its log's tail), or ``deadline`` (monotonic) passed.
    """
    while True:
        for name in watch:
            if not pid_alive(tb.pids[name], name):
                log = tb.state_dir / "logs" / f"{name}.log"
                raise TestbedError(
                    f"{name} exited while waiting for {what}; log {log}:\n{tail(log)}"
                )
        for node, pid in tb.agents.items():
            if not agent_alive(pid):
                log = tb.state_dir / "logs" / f"agent-{node}.log"
                raise TestbedError(
                    f"node agent of {node} exited while waiting for {what}; log {log}:\n{tail(log)}"
                )
        try:
            if check():
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TestbedError(f"timed out waiting for {what}; logs in {tb.state_dir / 'logs'}")
        time.sleep(0.5)


def https_ok(port: int, path: str, ctx: ssl.SSLContext) -> bool:
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=3)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        r.read()
        return r.status == 200
    finally:
        conn.close()


def start_etcd(tb: Testbed, deadline: float, attached: bool) -> None:
    """Start etcd and wait for its ``/health``."""
    ports = tb.ports
    etcd_url = f"http://127.0.0.1:{ports['etcd']}"
    peer_url = f"http://127.0.0.1:{ports['etcd_peer']}"
    start_component(
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

    wait_for(tb, "etcd /health", etcd_ok, deadline, ["etcd"])


def start_apiserver(tb: Testbed, pki: dict, deadline: float, attached: bool) -> None:
    """Start kube-apiserver (over the etcd of ``tb``) and wait for its ``/readyz``."""
    ports = tb.ports
    etcd_url = f"http://127.0.0.1:{ports['etcd']}"
    start_component(
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
    ctx = ssl_context(tb.state_dir / "pki")
    wait_for(
        tb,
        "kube-apiserver /readyz",
        lambda: https_ok(ports["apiserver"], "/readyz", ctx),
        deadline,
        ["etcd", "kube-apiserver"],
    )


def start_controllers(tb: Testbed, pki: dict, attached: bool) -> None:
    """Start kube-controller-manager, kube-scheduler and the kwok controller (no wait)."""
    ports = tb.ports
    kc = str(tb.kubeconfig)
    start_component(
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
    start_component(
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
    start_component(
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


def wait_controllers(tb: Testbed, deadline: float) -> None:
    """Wait for kube-controller-manager's ``/healthz`` and kube-scheduler's ``/readyz``."""
    ports = tb.ports
    all_components = list(tb.pids)
    insecure = ssl.create_default_context()
    insecure.check_hostname = False
    insecure.verify_mode = ssl.CERT_NONE  # self-signed serving certs of KCM/scheduler
    wait_for(
        tb,
        "kube-controller-manager /healthz",
        lambda: https_ok(ports["controller_manager"], "/healthz", insecure),
        deadline,
        all_components,
    )
    wait_for(
        tb,
        "kube-scheduler /readyz",
        lambda: https_ok(ports["scheduler"], "/readyz", insecure),
        deadline,
        all_components,
    )


def stop_components(tb: Testbed, timeout: float) -> None:
    """Stop every recorded component, in reverse start order (SIGTERM, then SIGKILL after
    ``timeout`` s each)."""
    # One at a time, clients first, so that the apiserver can still reach etcd while it
    # shuts down (and nothing logs a storm of connection errors).
    for name in reversed(COMPONENTS):
        pid = tb.pids.get(name)
        if not pid or not pid_alive(pid, name):
            continue
        terminate(pid, functools.partial(pid_alive, binary=name), timeout)
