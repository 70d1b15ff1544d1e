"""Unit tests of the node agent's pure decisions (``eaas.testbed.pod``)."""

from __future__ import annotations

import pytest

from eaas.testbed import pod as P

POD = {
    "metadata": {
        "name": "web-1",
        "namespace": "ns",
        "uid": "u-1",
        "labels": {"app": "web"},
        "annotations": {"a": "b"},
    },
    "spec": {"nodeName": "gpu-node-0", "serviceAccountName": "sa"},
}


def test_field_ref_covers_downward_api_fields():
    f = lambda path: P.field_ref(POD, path, "127.1.0.2", "127.0.0.1")  # noqa: E731
    assert f("metadata.name") == "web-1"
    assert f("metadata.namespace") == "ns"
    assert f("metadata.uid") == "u-1"
    assert f("metadata.labels['app']") == "web"
    assert f("metadata.annotations['a']") == "b"
    assert f("metadata.labels") == 'app="web"\n'
    assert f("spec.nodeName") == "gpu-node-0"
    assert f("spec.serviceAccountName") == "sa"
    assert f("status.podIP") == "127.1.0.2"
    assert f("status.hostIP") == "127.0.0.1"
    with pytest.raises(P.PodConfigError, match="spec.bogus"):
        f("spec.bogus")


def test_expand_follows_kubernetes_rules():
    env = {"A": "x", "B": "y"}
    assert P.expand("$(A)-$(B)", env) == "x-y"
    assert P.expand("$(MISSING)", env) == "$(MISSING)"
    assert P.expand("$$(A)", env) == "$(A)"
    assert P.expand("cost $$5", env) == "cost $5"


def test_container_env_order_refs_and_errors():
    data = {("configmap", "cm"): {"k": "v", "x": "1"}, ("secret", "s"): {"pw": "p"}}

    def lookup(kind, name):
        return data.get((kind, name))

    ctr = {
        "name": "c",
        "envFrom": [{"configMapRef": {"name": "cm"}, "prefix": "CM_"}],
        "env": [
            {"name": "NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "GREETING", "value": "hi-$(NAME)-$(CM_k)"},
            {"name": "PW", "valueFrom": {"secretKeyRef": {"name": "s", "key": "pw"}}},
            {"name": "CPU", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}},
            {
                "name": "OPT",
                "valueFrom": {"configMapKeyRef": {"name": "nope", "key": "k", "optional": True}},
            },
        ],
        "resources": {"limits": {"cpu": "2"}},
    }
    env = P.container_env(POD, ctr, "127.1.0.2", "127.0.0.1", {"PATH": "/bin"}, lookup)
    assert env["PATH"] == "/bin"
    assert env["CM_k"] == "v" and env["CM_x"] == "1"
    assert env["GREETING"] == "hi-web-1-v"
    assert env["PW"] == "p"
    assert env["CPU"] == "2"
    assert "OPT" not in env
    bad = {
        "name": "c",
        "env": [{"name": "X", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "zz"}}}],
    }
    with pytest.raises(P.PodConfigError, match="cm/zz"):
        P.container_env(POD, bad, "", "", {}, lookup)


def test_command_line_needs_a_command():
    assert P.command_line(
        {"name": "c", "command": ["eaas"], "args": ["--id", "$(N)"]}, {"N": "7"}
    ) == [
        "eaas",
        "--id",
        "7",
    ]
    with pytest.raises(P.PodConfigError, match="no command"):
        P.command_line({"name": "c", "args": ["x"]}, {})


def test_restart_policy_back_off_and_phase():
    assert P.should_restart("Always", 0) and P.should_restart("Always", 1)
    assert P.should_restart("OnFailure", 1) and not P.should_restart("OnFailure", 0)
    assert not P.should_restart("Never", 1)
    assert [P.backoff_s(n) for n in range(7)] == [10, 20, 40, 80, 160, 300, 300]
    assert P.backoff_s(2, base_s=1.0) == 4.0
    run = {"started": True, "running": True, "exit_code": None}
    ok = {"started": True, "running": False, "exit_code": 0}
    bad = {"started": True, "running": False, "exit_code": 2}
    new = {"started": False, "running": False, "exit_code": None}
    assert P.pod_phase("Always", [new, run]) == "Pending"
    assert P.pod_phase("Always", [run, ok]) == "Running"
    assert P.pod_phase("Never", [ok, ok]) == "Succeeded"
    assert P.pod_phase("Never", [ok, bad]) == "Failed"
    assert P.pod_phase("OnFailure", [ok, bad]) == "Running"  # the failed one restarts
    assert P.pod_phase("Always", [ok]) == "Running"


def test_ip_and_gpu_allocation():
    assert P.allocate_ip("127.1.3.0/24", []) == "127.1.3.2"
    assert P.allocate_ip("127.1.3.0/24", ["127.1.3.2", "127.1.3.4"]) == "127.1.3.3"
    with pytest.raises(RuntimeError, match="exhausted"):
        P.allocate_ip("127.1.3.0/30", ["127.1.3.2"])
    # after the previous allocation, wrapping around: a freed address is not reused at once
    assert P.allocate_ip("127.1.3.0/24", ["127.1.3.2"], last="127.1.3.3") == "127.1.3.4"
    assert P.allocate_ip("127.1.3.0/29", ["127.1.3.3"], last="127.1.3.6") == "127.1.3.2"
    assert P.allocate_ip("127.1.3.0/29", [], last="127.1.3.9") == "127.1.3.2"  # not in range
    assert P.allocate_gpus(2, 8, [0, 2]) == [1, 3]
    assert P.allocate_gpus(0, 8, range(8)) == []
    with pytest.raises(RuntimeError, match="need 3 GPUs"):
        P.allocate_gpus(3, 4, [0, 1])
    assert P.gpu_request({"resources": {"limits": {"nvidia.com/gpu": "2"}}}) == 2
    assert P.gpu_request({}) == 0
    assert (
        P.resolve_port({"name": "c", "ports": [{"name": "http", "containerPort": 80}]}, "http")
        == 80
    )
    assert P.resolve_port({"name": "c"}, 81) == 81
    with pytest.raises(P.PodConfigError, match="no port named"):
        P.resolve_port({"name": "c"}, "grpc")


@pytest.mark.failstatic
def test_status_drift_names_what_someone_else_overwrote():
    mine = {
        "phase": "Running",
        "podIP": "127.1.0.2",
        "conditions": [
            {"type": "Ready", "status": "True", "lastTransitionTime": "t0"},
            {"type": "ContainersReady", "status": "True"},
        ],
        "containerStatuses": [{"name": "c", "ready": True, "started": True, "restartCount": 1}],
    }
    assert P.status_drift(mine, mine) == []
    # the node controller's NodeNotReady mark: Ready=False, another writer's condition added
    api = {
        **mine,
        "conditions": [
            {"type": "Ready", "status": "False", "lastTransitionTime": "t1"},
            {"type": "ContainersReady", "status": "True"},
            {"type": "DisruptionTarget", "status": "True"},
        ],
    }
    assert P.status_drift(api, mine) == ["conditions[Ready]"]
    lost = {**mine, "containerStatuses": [{"name": "c", "ready": False, "restartCount": 0}]}
    assert P.status_drift(lost, mine) == ["containerStatuses[c]"]
    assert P.status_drift({}, mine) == [
        "phase",
        "podIP",
        "conditions[ContainersReady]",
        "conditions[Ready]",
        "containerStatuses[c]",
    ]
