"""Operator commands: ``operator``, ``crds``."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    app.command("operator")(run_operator)
    app.command("crds")(write_crds)


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
    (Deployment, Service, push-token Secret, clients' RBAC; pushes each table version to the
    clients). Several may run: they elect a leader on the Lease ``eaas-operator`` and only it
    acts (``EAAS_OPERATOR_LEASE_DURATION_S``, ``EAAS_OPERATOR_LEASE_NAMESPACE``,
    ``EAAS_OPERATOR_ID``). ``EAAS_OPERATOR_REPORT_LISTEN=HOST:PORT`` serves clients' failure
    reports, ``EAAS_OPERATOR_REPORT_URL`` is that address as clients reach it. Same as
    ``kopf run -m eaas.operator.handlers --all-namespaces --standalone``.
    """
    # lazy: kopf and the operator (kubernetes client, pydantic models) cost the start-up of every
    # other `eaas` command
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
    """Regenerate the ExpertPool and AttentionFleet CRD manifests from the models in operator/crd/."""
    # lazy: the CRD models (pydantic) cost the start-up of every other `eaas` command
    from eaas.operator.crd import CRD_DIRS
    from eaas.operator.crd import write_crds as _write

    dirs = [Path(d) for d in out] or [Path(root) / d for d in CRD_DIRS]
    for p in _write(dirs):
        typer.echo(str(p))
