"""ExpertPool ``spec.transport`` against the real API server.

Invalid transport combinations are rejected by the API server's CEL/openAPI validation with a
message naming the field; a valid NVSHMEM pool gets pods that join the world at their PE (the
pods are kwok pods: the test asserts the pod specs and the routing table, not that NVSHMEM
runs). Spares are extra pods started with ``--spare``.
"""

from __future__ import annotations

import pytest

from helpers.k8s import ROOT, apply, get, pods, pool_manifest, table, wait_for

pytestmark = pytest.mark.gpu_cpu

PVC = {"persistentVolumeClaim": "nvshmem-uid"}


def _nv(**nvshmem) -> dict:
    return {"scheme": "nvshmem", "nvshmem": {"clients": 2, "uidVolume": PVC, **nvshmem}}


@pytest.mark.parametrize(
    "transport,extra,message",
    [
        ({"scheme": "nvshmem"}, {}, "spec.transport.nvshmem is required with scheme nvshmem"),
        ({"scheme": "tcp", "nvshmem": _nv()["nvshmem"]}, {}, "only allowed with it"),
        ({"scheme": "rdma"}, {}, "spec.transport.scheme"),
        (_nv(clients=0), {}, "spec.transport.nvshmem.clients"),
        ({"scheme": "nvshmem", "nvshmem": {"clients": 1}}, {}, "spec.transport.nvshmem.uidVolume"),
        (_nv(uidVolume={}), {}, "give exactly one of hostPath and persistentVolumeClaim"),
        (
            _nv(uidVolume={"hostPath": "/x", "persistentVolumeClaim": "c"}),
            {},
            "give exactly one of hostPath and persistentVolumeClaim",
        ),
        (_nv(uidVolume={"hostPath": "relative"}), {}, "spec.transport.nvshmem.uidVolume.hostPath"),
        (
            _nv(uidVolume={"persistentVolumeClaim": "Bad_Name!"}),
            {},
            "spec.transport.nvshmem.uidVolume.persistentVolumeClaim",
        ),
        (_nv(spares=1), {}, "spec.transport.nvshmem.spares needs spec.placement.assignment"),
        (
            _nv(),
            {"autoscaling": {"minReplicas": 2, "maxReplicas": 4, "targetLoadPerServer": 10}},
            "spec.autoscaling is not supported with spec.transport.scheme nvshmem",
        ),
    ],
    ids=[
        "noWorld",
        "worldWithTcp",
        "scheme",
        "clients0",
        "noUidVolume",
        "emptyUidVolume",
        "twoUidVolumes",
        "relativeHostPath",
        "claimName",
        "sparesCommandLine",
        "autoscaling",
    ],
)
def test_invalid_transport_rejected(ns, operator, transport, extra, message):  # noqa: F811
    m = pool_manifest("bad", transport=transport, **extra)
    r = apply(m, ns, check=False)
    assert r.returncode != 0, "API server accepted an invalid transport"
    assert message in r.stderr, r.stderr
    assert get("expertpool", "bad", ns) is None
    assert pods(ns, "bad") == []


def _env(pod: dict) -> dict[str, str]:
    return {
        e["name"]: e["value"] for e in pod["spec"]["containers"][0].get("env", []) if "value" in e
    }


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_nvshmem_pool_pods_and_routing_table(ns, operator):  # noqa: F811
    """clients 2 + 4 servers: pod i is PE 2+i, the table lists ``nvshmem:PE``."""
    # hostPath: the testbed has no storage provisioner to bind a claim (the claim's volume is
    # checked by the pod builder unit tests)
    transport = _nv(ibgda=False, uidVolume={"hostPath": "/var/run/eaas-nv"})
    assert apply(pool_manifest("nv", transport=transport), ns).returncode == 0
    pool = get("expertpool", "nv", ns)
    assert pool["spec"]["transport"]["nvshmem"]["spares"] == 0  # defaulted by the API server

    def done():
        t = table(ns, "nv")
        ps = [p for p in pods(ns, "nv") if p["status"].get("phase") == "Running"]
        return (t, ps) if t is not None and len(ps) == 4 and len(t.servers) == 4 else None

    t, ps = wait_for("nvshmem pool pods and table", done, timeout=120)
    assert t.servers == {f"nv-{i}": f"nvshmem:{2 + i}" for i in range(4)}
    uid_files = set()
    for p in ps:
        i = int(p["metadata"]["labels"]["eaas.io/server-index"])
        c = p["spec"]["containers"][0]
        cmd = c["command"]
        assert _flag(cmd, "--listen") == f"nvshmem:{2 + i}"
        assert _flag(cmd, "--device") == "cuda"
        assert "--experts" in cmd and "--spare" not in cmd
        env = _env(p)
        assert env["EAAS_NVSHMEM_WORLD_SIZE"] == "6" and env["EAAS_NVSHMEM_PE"] == str(2 + i)
        assert env["NVSHMEM_IB_ENABLE_IBGDA"] == "0"
        uid_files.add(env["EAAS_NVSHMEM_UID_FILE"])
        assert env["EAAS_NVSHMEM_UID_FILE"].startswith("/var/run/eaas/nvshmem/nv-")
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
        vols = {v["name"]: v for v in p["spec"]["volumes"]}
        assert vols["nvshmem-uid"]["hostPath"] == {
            "path": "/var/run/eaas-nv",
            "type": "DirectoryOrCreate",
        }
        assert {"name": "nvshmem-uid", "mountPath": "/var/run/eaas/nvshmem"} in c["volumeMounts"]
    assert len(uid_files) == 1  # one world, one unique-id file


def test_nvshmem_spares_are_started_empty(ns, operator):  # noqa: F811
    """routing-table assignment + 2 spares: 6 pods, the last two ``--spare`` at PEs 5 and 6."""
    m = pool_manifest(
        "sp",
        transport=_nv(clients=1, spares=2, uidVolume={"hostPath": "/var/eaas"}),
        placement={"assignment": "routing-table"},
    )
    assert apply(m, ns).returncode == 0

    def six():
        ps = pods(ns, "sp")
        return ps if len(ps) == 6 else None

    ps = wait_for("4 servers + 2 spares", six, timeout=90)
    by_index = {int(p["metadata"]["labels"]["eaas.io/server-index"]): p for p in ps}
    assert sorted(by_index) == list(range(6))
    for i, p in by_index.items():
        cmd = p["spec"]["containers"][0]["command"]
        assert ("--spare" in cmd) == (i >= 4), cmd
        assert "--experts" not in cmd and "--push-token-file" in cmd
        assert _flag(cmd, "--listen") == f"nvshmem:{1 + i}"
        assert _env(p)["EAAS_NVSHMEM_WORLD_SIZE"] == "7"
        vols = {v["name"]: v for v in p["spec"]["volumes"]}
        assert vols["nvshmem-uid"]["hostPath"] == {"path": "/var/eaas", "type": "DirectoryOrCreate"}


def test_fleet_of_an_nvshmem_pool_joins_its_world(ns, operator):  # noqa: F811
    """The pool's AttentionFleet: client pods claim a client PE of the same world (same uid
    file), on a GPU, with ``--device cuda``; Recreate rollouts."""
    transport = _nv(clients=2, uidVolume={"hostPath": "/var/run/eaas-nv"})
    assert apply(pool_manifest("tiny", transport=transport), ns).returncode == 0
    fleet = {
        "apiVersion": "eaas.io/v1alpha1",
        "kind": "AttentionFleet",
        "metadata": {"name": "tiny-clients"},
        "spec": {"expertPoolRef": {"name": "tiny"}, "replicas": 2, "model": {"uri": "/m"}},
    }
    assert apply(fleet, ns).returncode == 0
    dep = wait_for("deployment", lambda: get("deployment", "tiny-clients", ns), timeout=60)
    assert dep["spec"]["strategy"]["type"] == "Recreate"
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert _flag(c["command"], "--device") == "cuda"
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    assert env["EAAS_NVSHMEM_WORLD_SIZE"] == "6" and env["EAAS_NVSHMEM_CLIENT_PES"] == "2"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    server = wait_for("a server pod", lambda: (pods(ns, "tiny") or [None])[0], timeout=60)
    assert env["EAAS_NVSHMEM_UID_FILE"] == _env(server)["EAAS_NVSHMEM_UID_FILE"]


def test_nvshmem_example_is_valid(ns, operator):  # noqa: F811
    """``deploy/examples/tiny-pool-nvshmem.yaml`` passes the API server's validation."""

    from helpers.k8s import kubectl

    path = str(ROOT / "deploy/examples/tiny-pool-nvshmem.yaml")
    r = kubectl("apply", "--dry-run=server", "-n", ns, "-f", path, check=False)
    assert r.returncode == 0, r.stderr
    assert "expertpool.eaas.io/tiny created (server dry run)" in r.stdout, r.stdout
