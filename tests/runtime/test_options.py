"""The options objects: validated once at construction, turned into the child's command line,
and what the attention client's dispatcher gets from them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from eaas.runtime.common.dtypes import SERVING_DTYPES, dtype_name, torch_dtype
from eaas.runtime.common.ports import free_tcp_port
from eaas.runtime.options import AttentionClientOptions, ExpertServerOptions, client_id_of


def test_spin_us_and_an_nvshmem_world_both_reach_the_connections():
    """``--spin-us`` with ``--nvshmem-world``: the shm / cudaipc connections still get the spin
    (it was silently dropped: the world's connect replaced the spin's) and ``nvshmem:`` ones the
    world."""
    from eaas.runtime.client.main import connect_with_options

    options = AttentionClientOptions(routing_table="t.json", spin_us=0.0, nvshmem_world=4)
    world = object()
    calls = []
    connect = connect_with_options(
        options.spin_us, world, lambda ep, sid, **kw: calls.append((ep, kw))
    )
    assert connect is not None
    connect("unix:/run/s.sock", "s0")
    connect("cudaipc:/run/c.sock", "s1")
    connect("nvshmem:3", "s2")
    connect("tcp://h:1", "s3")
    assert calls == [
        ("unix:/run/s.sock", {"spin_us": 0.0, "max_spin_us": 0.0}),
        ("cudaipc:/run/c.sock", {"spin_us": 0.0}),
        ("nvshmem:3", {"world": world}),
        ("tcp://h:1", {}),
    ]
    assert connect_with_options(None, None) is None  # the dispatcher's default connect


def test_options_are_validated_at_construction_naming_the_flag():
    cases = [
        ({"dispatch_timeout": 0.0}, "--dispatch-timeout must be > 0"),
        ({"dtype": "float16"}, "--dtype must be float32 or bfloat16"),
        ({"spin_us": float("inf")}, "--spin-us must be a finite"),
        ({"routing_table": None}, "--routing-table or --routing-table-configmap is required"),
        ({"failure_report_url": "ftp://x"}, "--failure-report-url must be http"),
        ({"client_id": " "}, "--client-id is empty"),
    ]
    for kw, needle in cases:
        with pytest.raises(ValueError, match=needle):
            AttentionClientOptions(**{"routing_table": "t.json", **kw})
    for kw, needle in [
        ({"spare": True, "experts": "1:0"}, "not with --experts"),
        ({"spare": True}, "--spare needs --push-token-file"),
        ({"push_token_file": "/t"}, "--push-token-file needs --http-port"),
        ({"dtype": "half"}, "--dtype must be"),
    ]:
        with pytest.raises(ValueError, match=needle):
            ExpertServerOptions(listen="tcp://0.0.0.0:1", **kw)


def test_argv_writes_the_flags_that_differ_from_the_defaults_in_field_order():
    server = ExpertServerOptions(
        model="/m", server_id="s", experts="1:0-3", listen="unix:/r/s.sock", sched_policy="batch"
    )
    assert server.argv() == [
        "expert-server",
        *("--model", "/m", "--server-id", "s", "--experts", "1:0-3"),
        *("--listen", "unix:/r/s.sock", "--sched-policy", "batch"),
    ]
    client = AttentionClientOptions(
        routing_table="/r/t.json", reuse_port=True, dispatch_timeout=0.25, spin_us=12.5
    )
    assert client.argv() == [
        "attention-client",
        *("--client-id", "0", "--routing-table", "/r/t.json", "--port", "8000"),
        *("--reuse-port", "--dispatch-timeout", "0.25", "--spin-us", "12.5"),
    ]
    assert AttentionClientOptions(routing_table="t", dispatch_timeout=1 / 3).argv()[-1] == repr(
        1 / 3
    )  # reads back exactly


def test_client_id_of_names_and_integers():
    assert client_id_of(" 17 ") == 17
    assert client_id_of("pod-a") == client_id_of("pod-a") != client_id_of("pod-b")
    assert 0 <= client_id_of("pod-a") < 2**63
    with pytest.raises(ValueError, match="must be in"):
        client_id_of("-1")


def test_dtype_map_and_free_port():
    import torch

    assert [torch_dtype(n) for n in SERVING_DTYPES] == [torch.float32, torch.bfloat16]
    assert torch_dtype("torch.half") is torch.float16 and dtype_name(torch.bfloat16) == "bfloat16"
    assert 0 < free_tcp_port() < 65536


def test_options_and_common_import_without_torch():
    code = (
        "import sys, eaas.runtime.options, eaas.runtime.common.dtypes, eaas.runtime.common.ports,"
        " eaas.runtime.common.process; assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_serve_options_are_validated_before_any_process_starts():
    from eaas.runtime.options import ServeOptions

    assert ServeOptions(client_spin_us="0").spin_us == 0.0
    assert ServeOptions().spin_us is None
    for kw, needle in [
        ({"transport": "udp"}, "--transport must be shm or tcp"),
        ({"transport": "tcp", "client_spin_us": "5"}, "acts on --transport shm only"),
        ({"client_spin_us": "inf"}, "--client-spin-us must be default or microseconds"),
        ({"client_device": "gpu"}, "--client-device must be auto, cpu, cuda or cuda:N"),
        ({"dispatch_timeout": -1.0}, "--dispatch-timeout must be > 0"),
    ]:
        with pytest.raises(ValueError, match=needle):
            ServeOptions(**kw)
