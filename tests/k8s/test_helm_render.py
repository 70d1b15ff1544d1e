"""The Helm chart rendered and linted, its objects accepted by a real API server (server-side
dry run). The chart installed on process nodes is tests/cluster/test_helm.py.
"""

from __future__ import annotations

import subprocess

import yaml

from helpers.k8s import ROOT, kubectl


def test_helm_chart(testbed, crds):
    chart = str(ROOT / "deploy/helm/eaas-operator")
    r = subprocess.run(["helm", "lint", chart], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run(
        [
            "helm",
            "template",
            "eaas",
            chart,
            "--namespace",
            "eaas-system",
            "--include-crds",
            "--set",
            "watchNamespaces={a,b}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    docs = [d for d in yaml.safe_load_all(r.stdout) if d]
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert ("CustomResourceDefinition", "expertpools.eaas.io") in kinds
    assert ("CustomResourceDefinition", "attentionfleets.eaas.io") in kinds
    assert {k for k, _ in kinds} >= {
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Deployment",
    }
    crd = next(d for d in docs if d["metadata"]["name"] == "expertpools.eaas.io")
    assert crd == yaml.safe_load((ROOT / "deploy/crds/expertpool.yaml").read_text())
    dep = next(d for d in docs if d["kind"] == "Deployment")
    cmd = dep["spec"]["template"]["spec"]["containers"][0]["command"]
    assert cmd[:2] == ["eaas", "operator"] and "--namespace=a" in cmd and "--namespace=b" in cmd
    role = next(d for d in docs if d["kind"] == "ClusterRole")
    granted = {
        (g, res) for rule in role["rules"] for g in rule["apiGroups"] for res in rule["resources"]
    }
    for need in [
        ("eaas.io", "expertpools"),
        ("eaas.io", "expertpools/status"),
        ("eaas.io", "attentionfleets"),
        ("", "pods"),
        ("", "configmaps"),
        ("apps", "deployments"),
        ("", "services"),
        ("", "events"),
    ]:
        assert need in granted, need
    # the real API server accepts the rendered objects
    kubectl("create", "namespace", "eaas-helm-test", check=False)
    try:
        r = subprocess.run(
            # without the `helm test` hook: a server dry run of its pod fails on its
            # ServiceAccount, which a dry run does not create (tests/cluster/test_helm.py runs it)
            ["helm", "template", "eaas", chart, "--namespace", "eaas-helm-test", "--skip-tests"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        kubectl("apply", "--dry-run=server", "-n", "eaas-helm-test", "-f", "-", input=r.stdout)
    finally:
        kubectl("delete", "namespace", "eaas-helm-test", "--wait=false", check=False)
