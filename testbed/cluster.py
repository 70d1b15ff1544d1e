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
  shortened (``--node-monitor-grace-period``
  :data:`.control_plane.NODE_MONITOR_GRACE_S` s, period 2 s, the upstream defaults are 50 s /
  5 s) so that a stopped node turns NotReady within seconds. The HorizontalPodAutoscaler
  controller syncs every :data:`.control_plane.HPA_SYNC_PERIOD_S` s (upstream 15 s).
* kube-scheduler — the real scheduler, so extended resources (``nvidia.com/gpu``,
  ``rdma/ib``), node selectors and affinity are enforced as in a real cluster.
* one node agent per *process node* (:mod:`.agent`): the node's kubelet. Pods bound to it run
  their containers' commands as local processes on the pod IP, with volumes, probes, restarts,
  termination and node Lease heartbeats. ``eaas testbed node stop|start NAME`` stops
  (power-off: its containers die) and restarts one agent.
* kwok — the kwok *controller* alone (not kwokctl), for *kwok nodes* (scale tests): it keeps
  those fake Node objects Ready (leases + status heartbeats) and moves pods bound to them to
  Running/Ready with pod IPs from the node's ``spec.podCIDR``, without running anything.
  Stages are the kwok defaults plus ``pod-ready-again`` (a Running pod the node controller
  marked Ready=False is Ready again, as a kubelet re-reports it; ``kwok-stages.yaml``). Docs:
  https://kwok.sigs.k8s.io/docs/
  (user/kwok-in-cluster, user/kwok-manage-nodes-and-pods, user/stages-configuration).

Every node ``i`` gets ``spec.podCIDR`` 127.<net>.<i>.0/24, so pod IPs are loopback addresses.
``net`` (1..254) is claimed per testbed (:func:`.pod_net.claim_pod_net`), so several testbeds
on one machine (parallel test runs) never hand out the same pod IP.
There is no container runtime and no image pull: a process node's single "image" is the local
``eaas`` install (see :mod:`.agent`).

State (``<state-dir>/testbed.json``): pids, ports, paths. ``down`` stops the node agents (and
with them every container), then the recorded processes (SIGTERM, then SIGKILL) and removes
the state dir. Default state dir: ``~/.cache/eaas/testbed/run``.

Modules: :mod:`.record` (the record and the admin's API calls), :mod:`.control_plane`,
:mod:`.nodes` (Node objects), :mod:`.agents` (node agents), :mod:`.pod_net`,
:mod:`.kubeconfig`, :mod:`.procs` (local processes); this module starts and stops the whole.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from . import binaries as _build
from . import pki as _pki
from .agents import start_agent, stop_agent
from .control_plane import (
    SERVICE_IP,
    start_apiserver,
    start_controllers,
    start_etcd,
    stop_components,
    wait_controllers,
    wait_for,
)
from .kubeconfig import write_kubeconfig
from .nodes import check_mount_namespaces, create_nodes, nodes_ready, process_node_names
from .pod_net import claim_pod_net, release_pod_net
from .procs import STATE_MARKER, free_port, kill_marked
from .record import Testbed, TestbedError, api, default_state_dir, healthy, load


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
    proc_names = process_node_names(process_nodes, gpu_names, cpu_names)
    if proc_names:
        check_mount_namespaces()
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
        "etcd": free_port(),
        "etcd_peer": free_port(),
        "apiserver": free_port(),
        "controller_manager": free_port(),
        "scheduler": free_port(),
    }
    url = f"https://127.0.0.1:{ports['apiserver']}"
    kubeconfig = state_dir / "kubeconfig"
    write_kubeconfig(kubeconfig, url, pki)
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
    echo("starting etcd")
    start_etcd(tb, deadline, attached)
    echo("starting kube-apiserver")
    start_apiserver(tb, pki, deadline, attached)
    echo("starting kube-controller-manager, kube-scheduler, kwok")
    start_controllers(tb, pki, attached)
    names = create_nodes(tb)
    for name in tb.process_nodes:
        start_agent(tb, name, attached=attached)
    wait_controllers(tb, deadline)
    all_components = list(tb.pids)
    wait_for(
        tb, f"{len(names)} nodes Ready", lambda: nodes_ready(tb, names), deadline, all_components
    )
    # The ServiceAccount admission plugin rejects pods until the `default` SA exists.
    wait_for(
        tb,
        "ServiceAccount default/default",
        lambda: api(tb, "GET", "/api/v1/namespaces/default/serviceaccounts/default")[0] == 200,
        deadline,
        all_components,
    )
    tb.save()


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
    stop_components(tb, timeout)
    # top-level mount points the agents had to create on the host (e.g. /models), if empty and
    # no container of another testbed has a mount there: removing a mount point detaches the
    # mounts on it in every mount namespace
    host_dirs = state_dir / "nodes" / "host-dirs"
    if host_dirs.is_file():
        for d in sorted(set(host_dirs.read_text().split())):
            if _mounted_anywhere(d):
                continue
            try:
                os.rmdir(d)
            except OSError:
                pass
    release_pod_net(tb)
    if remove:
        shutil.rmtree(state_dir, ignore_errors=True)
    echo(f"testbed stopped (state {state_dir}{' removed' if remove else ''})")
    return True


def _mounted_anywhere(path: str) -> bool:
    """Whether some process's mount namespace has a mount at ``path`` (``/proc/*/mountinfo``)."""
    for info in Path("/proc").glob("[0-9]*/mountinfo"):
        try:
            text = info.read_text()
        except OSError:
            continue
        if any(line.split(" ", 5)[4:5] == [path] for line in text.splitlines()):
            return True
    return False
