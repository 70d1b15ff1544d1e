"""Operator commands: ``operator``, ``testbed up|down|env``, ``crds``."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    app.command("operator")(run_operator)
    app.command("crds")(write_crds)
    testbed = typer.Typer(help="Local Kubernetes control plane for tests and demos (kube-apiserver, etcd, kwok).")
    testbed.command("up")(testbed_up)
    testbed.command("down")(testbed_down)
    testbed.command("env")(testbed_env)
    app.add_typer(testbed, name="testbed")


def run_operator(
    namespace: list[str] = typer.Option(
        [], "--namespace", "-n", help="Watch only these namespaces (repeatable; globs allowed). Default: all."
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
        [], "--out", help="Output directory (repeatable). Default: deploy/crds and the Helm chart's crds/."
    ),
    root: str = typer.Option(".", "--root", help="Repository root for the default outputs."),
) -> None:
    """Regenerate the ExpertPool and AttentionFleet CRD manifests from operator/crd.py."""
    from pathlib import Path

    from eaas.operator.crd import CRD_DIRS, write_crds as _write

    dirs = [Path(d) for d in out] or [Path(root) / d for d in CRD_DIRS]
    for p in _write(dirs):
        typer.echo(str(p))


def testbed_up() -> None:
    """Build (once, cached) and start the testbed control plane."""
    raise NotImplementedError


def testbed_down() -> None:
    """Stop the testbed control plane."""
    raise NotImplementedError


def testbed_env() -> None:
    """Print shell exports to use the testbed: eval \"$(eaas testbed env)\"."""
    raise NotImplementedError
