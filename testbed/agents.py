"""Node agents of the process nodes (:mod:`.agent`, one process each): start and stop them,
and ``eaas testbed node stop|start NAME`` (a node's power-off and power-on)."""

from __future__ import annotations

import sys
from pathlib import Path

from .procs import agent_alive, spawn, terminate
from .record import Testbed, TestbedError, require


def start_agent(tb: Testbed, node: str, attached: bool = False) -> int:
    """Start the node agent of process node ``node``; record and return its pid.

    ``attached``: the agent dies with the calling process (PR_SET_PDEATHSIG), as for ``up``.
    """
    node_dir = tb.state_dir / "nodes" / node
    node_dir.mkdir(parents=True, exist_ok=True)
    settings = tb.agent_settings
    log = tb.state_dir / "logs" / f"agent-{node}.log"
    argv = [
        sys.executable,
        "-m",
        "eaas.testbed.agent",
        f"--node={node}",
        f"--kubeconfig={tb.kubeconfig}",
        f"--state-dir={node_dir}",
        f"--apiserver-port={tb.ports['apiserver']}",
        f"--restart-backoff-s={settings.get('restart_backoff_s', 10.0)}",
        f"--volume-sync-s={settings.get('volume_sync_s', 60.0)}",
    ]
    tb.agents[node] = pid = spawn(argv, log, tb.state_dir, attached)
    tb.save()
    return pid


def stop_agent(tb: Testbed, node: str, timeout: float = 15) -> bool:
    """Stop the node agent of ``node`` (SIGTERM: it SIGKILLs its containers' process groups
    and exits without reporting, like a node losing power; SIGKILL after ``timeout`` s).
    Returns False if it was not running."""
    pid = tb.agents.pop(node, None)
    tb.save()
    if not pid or not agent_alive(pid):
        return False
    return terminate(pid, agent_alive, timeout)


def node_stop(name: str, state_dir: Path | None = None) -> None:
    """``eaas testbed node stop NAME``: power off process node ``name`` (its agent and every
    container on it stop; heartbeats stop, so the node-lifecycle controller marks it NotReady
    after ``NODE_MONITOR_GRACE_S`` s, :mod:`.control_plane`).

    Raises:
        TestbedError: no testbed, or ``name`` is not a process node.
    """
    tb = require(state_dir)
    if name not in tb.process_nodes:
        raise TestbedError(f"{name} is not a process node (process nodes: {tb.process_nodes})")
    stop_agent(tb, name)


def node_start(name: str, state_dir: Path | None = None) -> None:
    """``eaas testbed node start NAME``: start the agent of process node ``name`` again (its
    pods' containers start again, counted as restarts; the node turns Ready).

    Raises:
        TestbedError: no testbed, ``name`` is not a process node, or its agent already runs.
    """
    tb = require(state_dir)
    if name not in tb.process_nodes:
        raise TestbedError(f"{name} is not a process node (process nodes: {tb.process_nodes})")
    pid = tb.agents.get(name)
    if pid and agent_alive(pid):
        raise TestbedError(f"node {name} is already running (agent pid {pid})")
    start_agent(tb, name)
