"""Service names on the testbed: a Python process in a pod resolves ``<svc>.<ns>.svc`` to the
Service's Ready pods with the Service port mapped to the ``targetPort`` (the testbed's stand-in
for cluster DNS and kube-proxy, ``eaas.testbed.service_dns``)."""

from __future__ import annotations

import json
import sys
import uuid

import pytest

from eaas.testbed.service_dns import service_records

from helpers.k8s import kubectl, wait_for

pytestmark = pytest.mark.failstatic
PY = sys.executable


def _pod(name, labels, ready=True, ip="127.1.0.5", ports=()):
    return {
        "metadata": {"name": name, "namespace": "ns", "labels": labels},
        "spec": {"containers": [{"name": "c", "ports": list(ports)}]},
        "status": {
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def test_service_records_select_ready_pods_and_map_ports():
    svc = {
        "metadata": {"name": "op", "namespace": "ns"},
        "spec": {
            "selector": {"app": "op"},
            "ports": [{"port": 8081, "targetPort": "reports"}, {"port": 80, "targetPort": 9000}],
        },
    }
    headless_like = {"metadata": {"name": "kubernetes", "namespace": "ns"}, "spec": {}}
    pods = [
        _pod(
            "op-b",
            {"app": "op"},
            ip="127.1.0.7",
            ports=[{"name": "reports", "containerPort": 18081}],
        ),
        _pod(
            "op-a",
            {"app": "op"},
            ip="127.1.0.6",
            ports=[{"name": "reports", "containerPort": 18081}],
        ),
        _pod("op-c", {"app": "op"}, ready=False),
        _pod("other", {"app": "x"}),
    ]
    rec = service_records([svc, headless_like], pods)
    assert set(rec) == {"op.ns", "op.ns.svc", "op.ns.svc.cluster.local"}
    assert rec["op.ns.svc"] == [
        {"ip": "127.1.0.6", "ports": {"8081": 18081, "80": 9000}},
        {"ip": "127.1.0.7", "ports": {"8081": 18081, "80": 9000}},
    ]
    assert service_records([svc], [pods[2]])["op.ns.svc"] == []  # none Ready: no address


def test_a_pod_reaches_a_service_by_name(cluster):
    ns = f"dns-{uuid.uuid4().hex[:6]}"
    kubectl("create", "namespace", ns)
    server = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "web", "namespace": ns, "labels": {"app": "web"}},
        "spec": {
            "containers": [
                {
                    "name": "c",
                    "image": "eaas:local",
                    "command": [
                        "sh",
                        "-c",
                        f"echo hi > /tmp/x-{ns} && exec {PY} -m http.server 28090 -d /tmp",
                    ],
                    "ports": [{"name": "web", "containerPort": 28090}],
                    "readinessProbe": {"tcpSocket": {"port": 28090}, "periodSeconds": 1},
                }
            ]
        },
    }
    svc = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web", "namespace": ns},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": "web"}]},
    }
    code = (
        "import urllib.request;"
        f"print('GOT', urllib.request.urlopen('http://web.{ns}.svc/x-{ns}', timeout=10).read())"
    )
    client = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "client", "namespace": ns},
        "spec": {
            "restartPolicy": "OnFailure",
            "containers": [{"name": "c", "image": "eaas:local", "command": [PY, "-c", code]}],
        },
    }
    try:
        for obj in (svc, server):
            kubectl("apply", "-f", "-", input=json.dumps(obj))

        def ready():
            out = kubectl("get", "pod", "web", "-n", ns, "-o", "json", check=False)
            conds = (
                json.loads(out.stdout).get("status", {}).get("conditions", [])
                if out.returncode == 0
                else []
            )
            return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)

        wait_for("web Ready", ready, timeout=60)
        kubectl("apply", "-f", "-", input=json.dumps(client))

        def succeeded():
            out = kubectl(
                "get", "pod", "client", "-n", ns, "-o", "jsonpath={.status.phase}", check=False
            )
            return out.stdout.strip() == "Succeeded"

        wait_for("client pod succeeded (resolved and fetched)", succeeded, timeout=60)
        st = json.loads(kubectl("get", "pod", "client", "-n", ns, "-o", "json").stdout)["status"]
        assert st["containerStatuses"][0]["restartCount"] == 0  # the first try resolved it
    finally:
        kubectl("delete", "namespace", ns, "--wait=false", check=False)
