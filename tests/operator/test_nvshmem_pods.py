"""ExpertPool ``spec.transport``: the pods of an NVSHMEM world (pure pod builders).

Server pod ``i`` of a pool with ``transport: {scheme: nvshmem, nvshmem: {clients: C, spares: K}}``
gets PE ``C + i`` (``--listen nvshmem:PE``, ``--device cuda``), the world's env vars from
``world_env`` (``EAAS_NVSHMEM_*``, ``NVSHMEM_IB_ENABLE_IBGDA``), the uid volume and the GPU
resource; pods ``replicas .. replicas+K-1`` are spares (``--spare``, never placed on); the
routing table lists ``nvshmem:PE``. A tcp pool is unchanged.
"""

from __future__ import annotations

import pytest

from eaas.operator.crd import NVSHMEM_UID_MOUNT_DIR, ExpertPoolSpec
from eaas.operator.desired import (
    ObservedPod,
    Owner,
    build_routing_table,
    compute_placement,
    desired_server_pods,
    placement_revision,
)
from eaas.operator.pods import (
    desired_table_pods,
    nvshmem_uid_file,
    server_endpoint,
    server_pe,
    world_layout,
)
from eaas.runtime.options.nvshmem_world import WorldConfig
from eaas.runtime.tables.expert_spec import format_expert_spec

pytestmark = pytest.mark.gpu_cpu

OWNER = Owner(kind="ExpertPool", name="tiny", namespace="ns", uid="uid-1", generation=1)
PVC = {"persistentVolumeClaim": "nvshmem-uid"}


def make_spec(**over):
    base = {
        "model": {"uri": "/models/tiny", "firstMoeLayer": 1, "numMoeLayers": 3, "numExperts": 32},
        "replicas": 4,
    }
    base.update(over)
    return ExpertPoolSpec.model_validate(base)


def nv_spec(clients=2, spares=0, ibgda=True, volume=PVC, **over):
    return make_spec(
        transport={
            "scheme": "nvshmem",
            "nvshmem": {"clients": clients, "spares": spares, "uidVolume": volume, "ibgda": ibgda},
        },
        **over,
    )


def _env(container) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_tcp_pool_is_unchanged():
    spec = make_spec()
    assert spec.transport.scheme == "tcp" and spec.transport.nvshmem is None
    assert world_layout(spec) is None
    pods = desired_server_pods(OWNER, spec, compute_placement(spec), placement_revision(spec))
    (c,) = pods["tiny-1"]["spec"]["containers"]
    assert _flag(c["command"], "--listen") == "tcp://0.0.0.0:9000"
    assert "--device" not in c["command"] and "env" not in c
    assert [p["name"] for p in c["ports"]] == ["experts", "http"]
    assert server_endpoint(spec, 1, "10.0.0.7") == "tcp://10.0.0.7:9000"
    with pytest.raises(ValueError, match="not nvshmem"):
        server_pe(spec, 0)


def test_nvshmem_server_pods_join_the_world_at_their_pe():
    spec = nv_spec(clients=2, gpusPerServer=1)
    placement = compute_placement(spec)
    pods = desired_server_pods(OWNER, spec, placement, placement_revision(spec))
    assert list(pods) == ["tiny-0", "tiny-1", "tiny-2", "tiny-3"]  # no spares: none extra
    uid_file = nvshmem_uid_file("tiny", spec)
    assert uid_file.startswith(f"{NVSHMEM_UID_MOUNT_DIR}/tiny-") and uid_file.endswith(".uid")
    for i, pod in enumerate(pods.values()):
        (c,) = pod["spec"]["containers"]
        cmd = c["command"]
        assert _flag(cmd, "--listen") == f"nvshmem:{2 + i}"
        assert _flag(cmd, "--device") == "cuda"
        assert _flag(cmd, "--experts") == format_expert_spec(placement.servers[i])
        assert "--spare" not in cmd
        assert _env(c) == {
            "EAAS_NVSHMEM_WORLD_SIZE": "6",
            "EAAS_NVSHMEM_PE": str(2 + i),
            "EAAS_NVSHMEM_UID_FILE": uid_file,
            "NVSHMEM_IB_ENABLE_IBGDA": "1",
        }
        # the env is exactly what the runtime parses (eaas expert-server's env vars)
        cfg = WorldConfig.from_options(6, int(_env(c)["EAAS_NVSHMEM_PE"]), uid_file)
        assert cfg is not None and cfg.pe == 2 + i
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert c["resources"]["requests"]["nvidia.com/gpu"] == "1"
        assert {"name": "nvshmem-uid", "mountPath": NVSHMEM_UID_MOUNT_DIR} in c["volumeMounts"]
        assert {
            "name": "nvshmem-uid",
            "persistentVolumeClaim": {"claimName": "nvshmem-uid"},
        } in pod["spec"]["volumes"]
        assert [p["name"] for p in c["ports"]] == ["http"]  # no TCP data plane
        assert server_endpoint(spec, i, "10.0.0.9") == f"nvshmem:{2 + i}"


def test_spares_are_extra_pods_started_empty_and_never_placed_on():
    spec = nv_spec(
        clients=1, spares=2, ibgda=False, volume={"hostPath": "/var/eaas"},
        placement={"assignment": "routing-table"},
    )  # fmt: skip
    pods = desired_table_pods(OWNER, spec, "r1")
    assert list(pods) == [f"tiny-{i}" for i in range(6)]  # 4 servers + 2 spares
    for i, pod in pods.items():
        (c,) = pod["spec"]["containers"]
        idx = int(i.split("-")[1])
        cmd = c["command"]
        assert ("--spare" in cmd) == (idx >= 4), cmd
        assert "--experts" not in cmd and "--push-token-file" in cmd
        assert _flag(cmd, "--listen") == f"nvshmem:{1 + idx}"
        env = _env(c)
        assert env["EAAS_NVSHMEM_WORLD_SIZE"] == "7" and env["EAAS_NVSHMEM_PE"] == str(1 + idx)
        assert env["NVSHMEM_IB_ENABLE_IBGDA"] == "0"
        vols = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert vols["nvshmem-uid"]["hostPath"] == {"path": "/var/eaas", "type": "DirectoryOrCreate"}
        assert "server-push-token" in vols
    assert server_endpoint(spec, 5, "") == "nvshmem:6"
    assert server_endpoint(spec, 6, "") == ""  # outside the world (an excess pod): no endpoint


def test_world_change_means_a_new_uid_file_and_new_pods():
    a, b = nv_spec(clients=2), nv_spec(clients=2, replicas=5)
    assert nvshmem_uid_file("tiny", a) != nvshmem_uid_file("tiny", b)
    assert nvshmem_uid_file("tiny", a) == nvshmem_uid_file("tiny", nv_spec(clients=2))
    pa = desired_table_pods(OWNER, a, "r")["tiny-0"]
    pb = desired_table_pods(OWNER, b, "r")["tiny-0"]
    h = "eaas.io/spec-hash"
    assert pa["metadata"]["annotations"][h] != pb["metadata"]["annotations"][h]


def test_routing_table_lists_nvshmem_endpoints():
    spec = nv_spec(clients=3)
    placement = compute_placement(spec)
    live = [
        ObservedPod(name=f"tiny-{i}", index=i, experts=tuple(placement.servers[i]), ready=True,
                    ip=f"10.0.0.{i + 1}", phase="Running")
        for i in range(4)
    ]  # fmt: skip
    table = build_routing_table(spec, live, 1)
    assert table.servers == {f"tiny-{i}": f"nvshmem:{3 + i}" for i in range(4)}


def test_fleet_clients_join_the_pools_world():
    from eaas.operator.crd import AttentionFleetSpec
    from eaas.operator.desired import fleet_deployment

    fleet = AttentionFleetSpec.model_validate(
        {"expertPoolRef": {"name": "tiny"}, "replicas": 2, "model": {"uri": "/models/tiny"},
         "resources": {"requests": {"cpu": "2"}}}
    )  # fmt: skip
    owner = Owner(kind="AttentionFleet", name="tiny-clients", namespace="ns", uid="u2")
    pool = nv_spec(clients=2, spares=1, placement={"assignment": "routing-table"})
    dep = fleet_deployment(owner, fleet, pool)
    assert dep["spec"]["strategy"] == {"type": "Recreate"}
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert _flag(c["command"], "--device") == "cuda"
    assert _env(c) == {
        "EAAS_NVSHMEM_WORLD_SIZE": "7",  # 2 clients + 4 servers + 1 spare
        "EAAS_NVSHMEM_CLIENT_PES": "2",
        "EAAS_NVSHMEM_UID_FILE": nvshmem_uid_file("tiny", pool),  # the servers' file
        "NVSHMEM_IB_ENABLE_IBGDA": "1",
    }
    assert c["resources"] == {
        "requests": {"cpu": "2", "nvidia.com/gpu": "1"},
        "limits": {"nvidia.com/gpu": "1"},
    }
    assert {"name": "nvshmem-uid", "mountPath": NVSHMEM_UID_MOUNT_DIR} in c["volumeMounts"]
    assert any(v["name"] == "nvshmem-uid" for v in pod["volumes"])
    # the world's env is added to, not put in place of, the pod name the client id expands from
    pod_name = {"fieldRef": {"fieldPath": "metadata.name"}}
    assert {"name": "EAAS_POD_NAME", "valueFrom": pod_name} in c["env"]
    assert _flag(c["command"], "--client-id") == "$(EAAS_POD_NAME)"
    # a tcp pool's clients are unchanged
    plain = fleet_deployment(owner, fleet, make_spec())
    assert "strategy" not in plain["spec"]
    (pc,) = plain["spec"]["template"]["spec"]["containers"]
    assert "--device" not in pc["command"] and _env(pc) == {}
    assert pc["resources"] == {"requests": {"cpu": "2"}}


def test_spares_stand_in_for_missing_servers_in_the_placement():
    from eaas.operator.pods import table_members

    def pod(i, live=True):
        return ObservedPod(name=f"tiny-{i}", index=i, ready=live, ip="10.0.0.1", phase="Running")

    spec = nv_spec(clients=1, spares=2, placement={"assignment": "routing-table"})
    everyone = [pod(i) for i in range(6)]
    assert table_members(spec, everyone) == [f"tiny-{i}" for i in range(4)]  # spares idle
    # tiny-1 left the world (dead, or a replacement that cannot join): the first spare stands in
    without_1 = [p for p in everyone if p.index != 1]
    assert table_members(spec, without_1) == ["tiny-0", "tiny-2", "tiny-3", "tiny-4"]
    gone = [p for p in everyone if p.index not in (1, 2, 4)]
    assert table_members(spec, gone) == ["tiny-0", "tiny-3", "tiny-5"]  # no spare left
    # a tcp pool has no spares: an excess pod never becomes a member
    tcp = make_spec(placement={"assignment": "routing-table"})
    assert table_members(tcp, without_1) == ["tiny-0", "tiny-2", "tiny-3"]
