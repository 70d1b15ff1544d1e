"""``eaas expert-server --device`` and ``--spare`` (the CLI side of the GPU data plane).

* ``--device`` errors (exit 2, the flag named, no traceback) and the pure listen/world checks;
* a spare (``--spare``, real process on the ``shm`` transport, the tiny checkpoint) starts with
  no experts and reports ready (``/health`` 200, 0 experts), refuses frames (not hosted), then
  gets experts through a routing-table push and serves them: same numbers as the checkpoint's
  experts computed here;
* GPU only: a ``cudaipc`` server on ``--device cpu`` refuses a CUDA-payload client, and
  ``--device cuda`` loads the weights on the GPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from eaas.runtime.client.dispatch import Dispatcher
from eaas.runtime.cuda.device import check_listen_device, check_world_device
from eaas.runtime.experts import weighted_expert_sum
from eaas.runtime.models.arch import read_model_info
from eaas.runtime.models.weights import load_expert_weights
from eaas.runtime.tables.table import RoutingTable
from eaas.runtime.transport.base import STATUS_NOT_HOSTED, RequestFrame
from eaas.runtime.transport.factory import connect

from helpers.cli import run_eaas_all
from helpers.server import free_port, wait_until

pytestmark = pytest.mark.timeout(300)
TOKEN = "spare-token"


def _eaas(*args: str) -> tuple[int, str]:
    r = subprocess.run(
        [sys.executable, "-m", "eaas", *args], capture_output=True, text=True, timeout=120
    )
    return r.returncode, " ".join((r.stdout + r.stderr).split())


@pytest.mark.gpu_cpu
def test_listen_and_world_need_a_cuda_device():
    with pytest.raises(ValueError, match=r"--listen nvshmem:3 needs --device cuda.*--device cpu"):
        check_listen_device("nvshmem:3", "cpu")
    check_listen_device("nvshmem:3", "cuda")
    for ep in ("unix:/x.sock", "cudaipc:/x.sock", "tcp://127.0.0.1:1"):
        check_listen_device(ep, "cpu")  # cudaipc: host-emulation clients are fine on cpu
    with pytest.raises(ValueError, match="--nvshmem-world needs --device cuda"):
        check_world_device("cpu")
    check_world_device("cuda")


@pytest.mark.gpu_cpu
def test_expert_server_device_and_spare_errors(tmp_path):
    """Bad ``--device`` / ``--spare`` combinations fail before any weight loads."""
    sock = f"unix:{tmp_path}/es.sock"
    tok = tmp_path / "tok"
    tok.write_text(TOKEN)
    cases = [
        (["--device", "gpu"], "--device must be auto, cpu, cuda or cuda:N"),
        (["--spare", "--experts", "1:0"], "--spare starts with no experts: not with --experts"),
        (["--spare"], "--spare needs --push-token-file or --routing-table-configmap"),
    ]
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], "--device cuda: no CUDA device is available"))
        cases.append((["--device", "cuda:0", "--spare"], "--device cuda:0: no CUDA device"))
    results = run_eaas_all([["expert-server", "--listen", sock, *extra] for extra, _ in cases])
    for (extra, message), (rc, out) in zip(cases, results, strict=True):
        assert rc == 2, (extra, out)
        assert message in out, (extra, out)
        assert "Traceback" not in out, (extra, out)
    assert not Path(f"{tmp_path}/es.sock").exists()  # nothing was started


def _http(method: str, port: int, path: str, body: str | None = None):
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=None if body is None else body.encode(),
        method=method,
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.gpu_cpu
@pytest.mark.elastic
def test_spare_starts_empty_then_serves_experts_from_a_pushed_table(tmp_path, model_dir):
    model = model_dir
    info = read_model_info(model)
    layer = info.moe_layers[0]
    tok = tmp_path / "tok"
    tok.write_text(TOKEN + "\n")
    sock = f"unix:{tmp_path}/spare.sock"
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "eaas", "expert-server", "--model", model, "--server-id", "spare",
         "--spare", "--device", "cpu", "--listen", sock, "--http-port", str(port),
         "--push-token-file", str(tok)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    d = None
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert "expert-server spare ready on" in line and "hosting 0 experts" in line, line
        code, health = _http("GET", port, "/health")
        assert code == 200 and health["status"] == "ok" and health["experts"] == 0, health

        # ready but empty: a frame naming an expert is refused as not hosted, the server lives
        g = torch.Generator().manual_seed(3)
        T, k = 6, 2
        hidden = torch.randn(T, info.hidden_size, generator=g)
        idx = torch.stack([torch.randperm(4, generator=g)[:k] for _ in range(T)])
        w = torch.rand(T, k, generator=g)
        c = connect(sock, "spare", hidden_size=info.hidden_size, dtype=torch.float32)
        c.send(RequestFrame(0, layer, 1, 1, hidden, idx.to(torch.int32), w))
        r = c.recv(time.monotonic() + 30)
        assert r.status == STATUS_NOT_HOSTED and "does not host" in r.message, r.message
        c.close()

        # the routing table gives the spare experts 0-3 of the first MoE layer
        table = RoutingTable(
            version=1,
            num_experts=info.num_experts,
            servers={"spare": sock},
            layers={
                **{l: tuple(() for _ in range(info.num_experts)) for l in info.moe_layers},
                layer: tuple(("spare",) if e < 4 else () for e in range(info.num_experts)),
            },
        )
        code, body = _http("PUT", port, "/routing-table", table.to_json())
        assert code == 202 and body["assigned_version"] == 1, body
        assert wait_until(lambda: _http("GET", port, "/health")[1]["experts"] == 4, 60)

        d = Dispatcher(0, info.hidden_size, torch.float32, table, timeout=30.0)
        out = d.dispatch(layer, hidden, idx, w)
        hosted = load_expert_weights(model, [(layer, e) for e in range(4)], torch.float32)
        ref = weighted_expert_sum(hidden, idx, w, {e: hosted[(layer, e)] for e in range(4)})
        torch.testing.assert_close(out, ref)
        assert _http("GET", port, "/health")[1]["stats"]["tokens"] == T
    finally:
        if d is not None:
            d.close()
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


@pytest.mark.gpu
def test_cudaipc_server_on_cpu_refuses_a_cuda_payload(tmp_path):
    """``--device cpu`` + ``cudaipc:``: host-emulation clients only; a CUDA payload is refused
    with the reason (and the server keeps serving a host-emulation client)."""
    from eaas.runtime.cuda.device import CPU_SERVER_CUDA_PAYLOAD

    sock = f"cudaipc:{tmp_path}/es.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "eaas.runtime.server.main", "--listen", sock, "--experts",
         "1:0-3", "--random", "32:48:7", "--device", "cpu"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert "ready on" in (proc.stdout.readline() if proc.stdout else "")
        with pytest.raises(Exception, match="--device cuda"):
            connect(sock, "s", hidden_size=32, dtype=torch.float32, payload="cuda")
        assert "--device cuda" in CPU_SERVER_CUDA_PAYLOAD
        c = connect(sock, "s", hidden_size=32, dtype=torch.float32, payload="host")
        c.send(RequestFrame(0, 1, 1, 1, torch.randn(2, 32), torch.zeros(2, 1, dtype=torch.int32),
                            torch.ones(2, 1)))  # fmt: skip
        assert c.recv(time.monotonic() + 30).status == 0
        c.close()
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.gpu_cpu
def test_serve_server_device_is_checked_up_front():
    """``eaas serve --server-device`` is the expert servers' ``--device`` (default cpu: the CPU
    path unchanged), checked before any process starts."""
    port = str(free_port())
    cases = [(["--server-device", "gpu"], "--server-device must be auto, cpu, cuda or cuda:N")]
    if not torch.cuda.is_available():
        cases.append((["--server-device", "cuda"], "--server-device cuda: no CUDA device"))
    for extra, message in cases:
        rc, out = _eaas("serve", "--port", port, *extra)
        assert rc == 2, (extra, out)
        assert message in out, (extra, out)
        assert "Traceback" not in out, (extra, out)


@pytest.mark.gpu
def test_cli_expert_server_on_cuda_serves_cudaipc_cuda_payload(tmp_path, model_dir):
    """``eaas expert-server --device cuda``: checkpoint weights on the GPU (native grouped
    kernels), a CUDA-payload ``cudaipc`` client gets CUDA outputs equal to the CPU reference."""
    model = model_dir
    info = read_model_info(model)
    layer = info.moe_layers[0]
    sock = f"cudaipc:{tmp_path}/g.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "eaas", "expert-server", "--model", model, "--server-id", "g",
         "--experts", f"{layer}:0-3", "--device", "cuda", "--listen", sock],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert "hosting 4 experts" in (proc.stdout.readline() if proc.stdout else "")
        g = torch.Generator().manual_seed(5)
        hidden = torch.randn(9, info.hidden_size, generator=g)
        idx = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(9)])
        w = torch.rand(9, 2, generator=g)
        c = connect(sock, "g", hidden_size=info.hidden_size, dtype=torch.float32, payload="cuda")
        c.send(RequestFrame(0, layer, 1, 1, hidden.cuda(), idx.to(torch.int32).cuda(), w.cuda()))
        r = c.recv(time.monotonic() + 60)
        assert r.status == 0, r.message
        assert r.output.is_cuda
        hosted = load_expert_weights(model, [(layer, e) for e in range(4)], torch.float32)
        ref = weighted_expert_sum(hidden, idx, w, {e: hosted[(layer, e)] for e in range(4)})
        torch.testing.assert_close(r.output.cpu(), ref, rtol=1e-4, atol=1e-5)
        c.close()
    finally:
        proc.terminate()
        proc.wait(30)
