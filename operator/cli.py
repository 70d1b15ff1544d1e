"""Operator commands: ``operator``, ``testbed up|down|env``, ``crds``."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    app.command("operator")(run_operator)
    testbed = typer.Typer(help="Local Kubernetes control plane for tests and demos (kube-apiserver, etcd, kwok).")
    testbed.command("up")(testbed_up)
    testbed.command("down")(testbed_down)
    testbed.command("env")(testbed_env)
    app.add_typer(testbed, name="testbed")


def run_operator() -> None:
    """Run the EaaS operator (kopf) against the current kubeconfig."""
    raise NotImplementedError


def testbed_up() -> None:
    """Build (once, cached) and start the testbed control plane."""
    raise NotImplementedError


def testbed_down() -> None:
    """Stop the testbed control plane."""
    raise NotImplementedError


def testbed_env() -> None:
    """Print shell exports to use the testbed: eval \"$(eaas testbed env)\"."""
    raise NotImplementedError
