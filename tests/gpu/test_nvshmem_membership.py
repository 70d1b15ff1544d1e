"""NVSHMEM transport: elastic membership over a fixed PE world (spare PEs), endpoints, and the
clear errors of the parts that need a GPU / nvshmem4py."""

from __future__ import annotations

import pytest
import torch

from eaas.runtime.transport.factory import connect, listen
from eaas.runtime.transport.nvshmem import (
    MembershipError,
    PeMembership,
    WorldSpec,
    ibgda_env,
    parse_endpoint,
)

pytestmark = pytest.mark.gpu_cpu


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
