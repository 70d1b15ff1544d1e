"""``eaas testbed build|up|down|env|node``: the local Kubernetes testbed's commands."""

from __future__ import annotations

from pathlib import Path

import typer

_STATE_HELP = "Default: ~/.cache/eaas/testbed/run."


def _state_path(state_dir: str | None) -> Path | None:
    """``--state-dir`` as a path; None (the default state folder) when unset or empty."""
    return Path(state_dir) if state_dir else None


def register(app: typer.Typer) -> None:
    """Add the ``testbed`` command group to ``app``."""
    testbed = typer.Typer(
        help="Local Kubernetes cluster for tests and demos: etcd, kube-apiserver, "
        "controller-manager, scheduler; process nodes run pods as local processes, kwok "
        "nodes simulate them."
    )
    testbed.command("build")(testbed_build)
    testbed.command("up")(testbed_up)
    testbed.command("down")(testbed_down)
    testbed.command("env")(testbed_env)
    node = typer.Typer(help="Stop or start a process node (its node agent and containers).")
    node.command("stop")(node_stop)
    node.command("start")(node_start)
    testbed.add_typer(node, name="node")
    app.add_typer(testbed, name="testbed")


def testbed_build(
    force: bool = typer.Option(False, "--force", help="Rebuild even if the binaries are cached."),
) -> None:
    """Build (or reuse) the testbed binaries in ~/.cache/eaas/testbed/; prints the bin dir."""
    # lazy: every `eaas` command imports this module; the testbed loads only when used
    from eaas.testbed import BuildError, build

    try:
        bin_dir = build(force=force, echo=lambda m: typer.echo(m, err=True))
    except BuildError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(str(bin_dir))


def testbed_up(
    gpu_nodes: int = typer.Option(4, "--gpu-nodes", help="GPU nodes: nvidia.com/gpu=8, rdma/ib=8."),
    cpu_nodes: int = typer.Option(1, "--cpu-nodes", help="CPU-only nodes."),
    process_nodes: str = typer.Option(
        "all",
        "--process-nodes",
        help="Nodes whose pods really run as local processes: 'all', 'none', or names "
        "(comma-separated, e.g. gpu-node-0,cpu-node-0). The others are kwok nodes (pods turn "
        "Ready without running; for scale tests).",
    ),
    restart_backoff_s: float = typer.Option(
        10.0, "--restart-backoff-s", help="Crash-loop back-off base (doubles up to 300 s)."
    ),
    volume_sync_s: float = typer.Option(
        60.0,
        "--volume-sync-s",
        help="Delay before configMap/secret volume files follow a change (the kubelet's sync).",
    ),
    state_dir: str | None = typer.Option(None, "--state-dir", help=_STATE_HELP),
    timeout: float = typer.Option(300, "--timeout", help="Seconds to wait for readiness."),
) -> None:
    """Build (once, cached) and start the testbed control plane and its nodes."""
    # lazy: every `eaas` command imports this module; the testbed loads only when used
    from eaas.testbed import BuildError, TestbedError, up

    try:
        tb = up(
            state_dir=_state_path(state_dir),
            gpu_nodes=gpu_nodes,
            cpu_nodes=cpu_nodes,
            timeout=timeout,
            echo=lambda m: typer.echo(m, err=True),
            process_nodes=process_nodes,
            restart_backoff_s=restart_backoff_s,
            volume_sync_s=volume_sync_s,
        )
    except (BuildError, TestbedError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(
        f'kubeconfig: {tb.kubeconfig}\nuse it: eval "$(eaas testbed env'
        + (f" --state-dir {tb.state_dir}" if state_dir else "")
        + ')"',
        err=True,
    )


def testbed_down(
    state_dir: str | None = typer.Option(None, "--state-dir", help=_STATE_HELP),
) -> None:
    """Stop the testbed (node agents and their containers first) and remove its state."""
    # lazy: every `eaas` command imports this module; the testbed loads only when used
    from eaas.testbed import down

    down(state_dir=_state_path(state_dir), echo=lambda m: typer.echo(m, err=True))


def testbed_env(
    state_dir: str | None = typer.Option(None, "--state-dir", help=_STATE_HELP),
) -> None:
    """Print shell exports to use the testbed: eval \"$(eaas testbed env)\"."""
    # lazy: every `eaas` command imports this module; the testbed loads only when used
    from eaas.testbed import TestbedError, env_lines

    try:
        typer.echo(env_lines(_state_path(state_dir)), nl=False)
    except TestbedError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None


def node_stop(
    name: str = typer.Argument(..., help="Process node name, e.g. gpu-node-1."),
    state_dir: str | None = typer.Option(None, "--state-dir", help=_STATE_HELP),
) -> None:
    """Power off a process node: its agent and containers stop, heartbeats stop, and the
    node-lifecycle controller marks it NotReady (about 20 s)."""
    # lazy: every `eaas` command imports this module; the testbed loads only when used
    from eaas.testbed import node_stop as _stop

    _node_command(_stop, name, state_dir, "stopped")


def node_start(
    name: str = typer.Argument(..., help="Process node name, e.g. gpu-node-1."),
    state_dir: str | None = typer.Option(None, "--state-dir", help=_STATE_HELP),
) -> None:
    """Start a stopped process node's agent again (its pods' containers restart)."""
    # lazy: every `eaas` command imports this module; the testbed loads only when used
    from eaas.testbed import node_start as _start

    _node_command(_start, name, state_dir, "started")


def _node_command(action, name: str, state_dir: str | None, done: str) -> None:
    """Run ``action(name, state_dir=...)`` (``node_stop``/``node_start``); a TestbedError
    becomes ``error: ...`` and exit status 1."""
    # lazy: as above
    from eaas.testbed import TestbedError

    try:
        action(name, state_dir=_state_path(state_dir))
    except TestbedError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"node {name} {done}", err=True)
