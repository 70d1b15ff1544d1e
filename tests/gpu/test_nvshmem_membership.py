"""NVSHMEM transport: elastic membership over a fixed PE world (spare PEs), endpoints, and the
clear errors of the parts that need a GPU / nvshmem4py."""

from __future__ import annotations

import threading

import pytest
import torch

from eaas.runtime.transport.factory import connect, listen
from eaas.runtime.transport.nvshmem import (
    ENV_PE,
    ENV_UID_FILE,
    ENV_WORLD_SIZE,
    MembershipError,
    PeMembership,
    WorldConfig,
    WorldLayout,
    WorldSpec,
    check_listen_pe,
    exchange_uid,
    ibgda_env,
    nvshmem_unavailable_reason,
    open_world,
    parse_endpoint,
    world_env,
)

from helpers.cli import run_eaas_all


def test_join_leave_retire_over_spare_pes():
    m = PeMembership(world_size=6, clients=frozenset({0, 1}))
    assert m.spares == [2, 3, 4, 5]
    assert [m.join(s) for s in ("a", "b", "c")] == [2, 3, 4]
    assert m.join("b") == 3  # idempotent
    assert m.endpoint("c") == "nvshmem:4"
    assert m.leave("b") == 3 and m.spares == [3, 5]  # scale-in: the PE is a spare again
    assert m.retire("a") == 2 and 2 not in m.spares  # dead: never reused in this world
    assert m.join("d") == 3 and m.join("e") == 5
    with pytest.raises(MembershipError, match="start a new world"):
        m.join("f")
    with pytest.raises(MembershipError, match="holds no PE"):
        m.leave("zzz")
    with pytest.raises(MembershipError, match="outside the world"):
        PeMembership(world_size=2, clients=frozenset({2}))


def test_endpoints_and_settings():
    assert parse_endpoint("nvshmem:12") == 12
    for bad in ("nvshmem:", "nvshmem:x", "unix:/a"):
        with pytest.raises(ValueError):
            parse_endpoint(bad)
    assert ibgda_env() == {"NVSHMEM_IB_ENABLE_IBGDA": "1"}
    spec = WorldSpec(max_pes=4, hidden_size=7168, dtype=torch.bfloat16, cap_tokens=256, cap_k=8)
    assert spec.request_bytes() == 64 + 256 * 7168 * 2 + 2 * 256 * 8 * 4
    assert spec.response_bytes() == 64 + 1024 + 256 * 7168 * 2


def test_factory_gives_clear_errors_without_a_world():
    with pytest.raises(Exception, match="world=NvshmemWorld"):
        connect("nvshmem:1", "s", hidden_size=8, dtype=torch.float32)
    with pytest.raises(Exception, match="world=NvshmemWorld"):
        listen("nvshmem:1", hidden_size=8, dtype=torch.float32)


def test_world_layout_assigns_clients_then_servers_then_spares():
    lay = WorldLayout(clients=2, servers=3, spares=2)
    assert lay.world_size == 7
    assert [lay.pe("client", i) for i in range(2)] == [0, 1]
    assert [lay.pe("server", i) for i in range(3)] == [2, 3, 4]
    assert [lay.pe("spare", i) for i in range(2)] == [5, 6]
    with pytest.raises(ValueError, match="server index 3 outside 0..2"):
        lay.pe("server", 3)
    with pytest.raises(ValueError, match="role must be"):
        lay.pe("router", 0)
    with pytest.raises(ValueError, match=">= 1 client"):
        WorldLayout(clients=0, servers=1, spares=0)
    m = lay.membership()  # the spares are what PeMembership hands out on join
    assert m.spares == [5, 6] and m.endpoint("server-1") == "nvshmem:3"
    assert m.join("new") == 5


def test_world_env_is_what_world_config_reads_back():
    lay = WorldLayout(clients=1, servers=2, spares=1)
    env = world_env(lay, "server", 1, "/shared/uid", ibgda=False)
    assert env == {
        ENV_WORLD_SIZE: "4",
        ENV_PE: "2",
        ENV_UID_FILE: "/shared/uid",
        "NVSHMEM_IB_ENABLE_IBGDA": "0",
    }
    cfg = WorldConfig.from_options(int(env[ENV_WORLD_SIZE]), int(env[ENV_PE]), env[ENV_UID_FILE])
    assert cfg == WorldConfig(4, 2, "/shared/uid")
    assert WorldConfig.from_options(None, None, None) is None
    with pytest.raises(ValueError, match="go together"):
        WorldConfig.from_options(4, None, "/x")
    with pytest.raises(ValueError, match="--nvshmem-pe 4 outside the world of 4"):
        WorldConfig(4, 4, "/x")
    with pytest.raises(ValueError, match=">= 2 PEs"):
        WorldConfig(1, 0, "/x")


def test_check_listen_pe():
    cfg = WorldConfig(4, 2, "/x")
    check_listen_pe("nvshmem:2", cfg)
    check_listen_pe("tcp://0.0.0.0:1", None)  # other transports need no world
    with pytest.raises(ValueError, match="needs the NVSHMEM world"):
        check_listen_pe("nvshmem:2", None)
    with pytest.raises(ValueError, match="not this process's --nvshmem-pe 2"):
        check_listen_pe("nvshmem:3", cfg)


def test_exchange_uid_pe0_writes_others_read(tmp_path):
    path = str(tmp_path / "uid")
    got: list[bytes] = []
    readers = [
        threading.Thread(target=lambda pe=pe: got.append(exchange_uid(WorldConfig(3, pe, path),
                                                                      None, timeout=60)))
        for pe in (1, 2)
    ]  # fmt: skip
    for t in readers:
        t.start()
    uid = exchange_uid(WorldConfig(3, 0, path), lambda: b"\x01\x02unique", timeout=60)
    for t in readers:
        t.join(60)
    assert uid == b"\x01\x02unique" and got == [uid, uid]
    with pytest.raises(TimeoutError, match="did not appear"):
        exchange_uid(WorldConfig(3, 1, str(tmp_path / "never")), None, timeout=0.2)


@pytest.mark.skipif(
    nvshmem_unavailable_reason() is None, reason="checks the error where nvshmem4py/GPU is missing"
)
def test_open_world_without_nvshmem4py_is_a_clear_error(tmp_path):
    from eaas.runtime.cuda import GpuUnavailableError

    with pytest.raises(GpuUnavailableError, match="nvshmem4py|CUDA device"):
        open_world(WorldConfig(2, 0, str(tmp_path / "uid")), WorldSpec(2, 8, torch.float32))
    assert not (tmp_path / "uid").exists()  # nothing written before the check


@pytest.mark.skipif(
    nvshmem_unavailable_reason() is None, reason="checks the error where nvshmem4py/GPU is missing"
)
def test_cli_nvshmem_world_errors(tmp_path):
    """The NVSHMEM flags fail fast (exit 2, one message, no traceback) on this machine."""
    uid = str(tmp_path / "uid")
    world = ["--nvshmem-world", "4", "--nvshmem-pe", "1", "--nvshmem-uid-file", uid]
    cases = [
        (["expert-server", "--listen", "nvshmem:1", *world], "nvshmem4py"),
        (["expert-server", "--listen", "nvshmem:1"], "needs the NVSHMEM world"),
        (["expert-server", "--listen", "nvshmem:2", *world], "not this process's --nvshmem-pe 1"),
        (["expert-server", "--listen", "tcp://127.0.0.1:0", "--nvshmem-world", "4"], "go together"),
        (["attention-client", "--routing-table", uid, "--port", "1", *world], "nvshmem4py"),
    ]
    results = run_eaas_all([args for args, _ in cases])
    for (args, message), (rc, out) in zip(cases, results, strict=True):
        assert rc == 2, (args, out)
        assert message in out, (args, out)
        assert "Traceback" not in out, (args, out)


def test_client_pe_claims_are_exclusive_and_stable(tmp_path):
    from eaas.runtime.options.nvshmem_world import MembershipError, claim_client_pe

    uid = str(tmp_path / "w.uid")
    got: list[int] = []
    lock = threading.Lock()

    def claim(name):
        pe = claim_client_pe(uid, 3, name)
        with lock:
            got.append(pe)

    ts = [threading.Thread(target=claim, args=(f"pod-{i}",)) for i in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert sorted(got) == [0, 1, 2]  # concurrent claimers: distinct PEs
    mine = claim_client_pe(uid, 3, "pod-1")  # a restarted container of the same pod
    assert (tmp_path / f"w.uid.client-{mine}").read_text().strip() == "pod-1"
    with pytest.raises(MembershipError, match="no free client PE in 0..2"):
        claim_client_pe(uid, 3, "pod-new")  # a replacement pod: the world must restart
    with pytest.raises(ValueError, match="one-line name"):
        claim_client_pe(uid, 3, "")


@pytest.mark.skipif(
    nvshmem_unavailable_reason() is None, reason="checks the error where nvshmem4py/GPU is missing"
)
def test_cli_client_pe_claim_errors(tmp_path):
    uid = str(tmp_path / "uid")
    base = ["attention-client", "--routing-table", uid, "--port", "1"]
    cases = [
        (["--nvshmem-client-pes", "2", "--nvshmem-pe", "0", "--nvshmem-world", "4",
          "--nvshmem-uid-file", uid], "give --nvshmem-pe or --nvshmem-client-pes, not both"),
        (["--nvshmem-client-pes", "2"], "needs --nvshmem-world and --nvshmem-uid-file"),
        (["--nvshmem-client-pes", "4", "--nvshmem-world", "4", "--nvshmem-uid-file", uid],
         "must be in 1..3"),
        (["--nvshmem-client-pes", "2", "--nvshmem-world", "4", "--nvshmem-uid-file", uid],
         "nvshmem4py"),
    ]  # fmt: skip
    results = run_eaas_all([[*base, *args] for args, _ in cases])
    for (args, message), (rc, out) in zip(cases, results, strict=True):
        assert rc == 2, (args, out)
        assert message in out, (args, out)
    assert list(tmp_path.iterdir()) == []  # nothing claimed where the world cannot be joined
