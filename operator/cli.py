"""Operator commands: ``operator``, ``testbed up|down|env``, ``crds``."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    app.command("operator")(run_operator)
    app.command("crds")(write_crds)
    testbed = typer.Typer(
        help="Local Kubernetes control plane for tests and demos (kube-apiserver, etcd, kwok)."
    )
    testbed.command("build")(testbed_build)
    testbed.command("up")(testbed_up)
    testbed.command("down")(testbed_down)
    testbed.command("env")(testbed_env)
    app.add_typer(testbed, name="testbed")


def run_operator(
    namespace: list[str] = typer.Option(
        [],
        "--namespace",
        "-n",
        help="Watch only these namespaces (repeatable; globs allowed). Default: all.",
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logging."),
    liveness: str = typer.Option(
        None, "--liveness", help="Serve a liveness probe, e.g. http://0.0.0.0:8080/healthz."
    ),
) -> None:
    """Run the EaaS operator (kopf) against the in-cluster config or the current kubeconfig.

    Reconciles ExpertPool (expert-server pods, routing-table ConfigMap) and AttentionFleet
    (Deployment + Service). Same as ``kopf run -m eaas.operator.handlers --all-namespaces``.
    """
    import kopf

    import eaas.operator.handlers  # noqa: F401  (registers the handlers)

    kopf.configure(verbose=verbose)
    kopf.run(
        clusterwide=not namespace,
        namespaces=tuple(namespace),
        standalone=True,
        liveness_endpoint=liveness,
    )


def write_crds(
    out: list[str] = typer.Option(
        [],
        "--out",
        help="Output directory (repeatable). Default: deploy/crds and the Helm chart's crds/.",
    ),
    root: str = typer.Option(".", "--root", help="Repository root for the default outputs."),
) -> None:
    """Regenerate the ExpertPool and AttentionFleet CRD manifests from operator/crd.py."""
    from pathlib import Path

    from eaas.operator.crd import CRD_DIRS
    from eaas.operator.crd import write_crds as _write

    dirs = [Path(d) for d in out] or [Path(root) / d for d in CRD_DIRS]
    for p in _write(dirs):
        typer.echo(str(p))


def testbed_build(
    force: bool = typer.Option(False, "--force", help="Rebuild even if the binaries are cached."),
) -> None:
    """Build (or reuse) the testbed binaries in ~/.cache/eaas/testbed/; prints the bin dir."""
    from eaas.operator.testbed import BuildError, build

    try:
        bin_dir = build(force=force, echo=lambda m: typer.echo(m, err=True))
    except BuildError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(str(bin_dir))


def testbed_up(
    gpu_nodes: int = typer.Option(
        4, "--gpu-nodes", help="Fake GPU nodes: nvidia.com/gpu=8, rdma/ib=8."
    ),
    cpu_nodes: int = typer.Option(1, "--cpu-nodes", help="Fake CPU-only nodes."),
    state_dir: str = typer.Option(None, "--state-dir", help="Default: ~/.cache/eaas/testbed/run."),
    timeout: float = typer.Option(300, "--timeout", help="Seconds to wait for readiness."),
) -> None:
    """Build (once, cached) and start the testbed control plane."""
    from eaas.operator.testbed import BuildError, TestbedError, up

    try:
        tb = up(
            state_dir=state_dir,
            gpu_nodes=gpu_nodes,
            cpu_nodes=cpu_nodes,
            timeout=timeout,
            echo=lambda m: typer.echo(m, err=True),
        )
    except (BuildError, TestbedError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(
        f'kubeconfig: {tb.kubeconfig}\nuse it: eval "$(eaas testbed env'
        + (f" --state-dir {tb.state_dir}" if state_dir else "")
        + ')"',
        err=True,
    )


def testbed_down(
    state_dir: str = typer.Option(None, "--state-dir", help="Default: ~/.cache/eaas/testbed/run."),
) -> None:
    """Stop the testbed control plane and remove its state."""
    from eaas.operator.testbed import down

    down(state_dir=state_dir, echo=lambda m: typer.echo(m, err=True))


def testbed_env(
    state_dir: str = typer.Option(None, "--state-dir", help="Default: ~/.cache/eaas/testbed/run."),
) -> None:
    """Print shell exports to use the testbed: eval \"$(eaas testbed env)\"."""
    from eaas.operator.testbed import TestbedError, env_lines

    try:
        typer.echo(env_lines(state_dir), nl=False)
    except TestbedError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
