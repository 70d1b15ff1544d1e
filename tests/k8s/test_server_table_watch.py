"""An expert server learns its experts from the routing-table ConfigMap through the API server
(``eaas expert-server --routing-table-configmap NS/NAME``, no ``--experts``),
against the testbed's real kube-apiserver.

The server starts empty; version 1 assigns it layer-1 experts 0-3 (it loads them while serving
and reports ``weights_version`` 1), version 2 moves it to experts 4-5: it loads them and, as no
operator releases versions on this path, keeps the previous version's experts too; version 3
drops version 1's (only the newest two versions are kept). An older version is ignored.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from eaas.runtime.models.arch import read_model_info
from eaas.runtime.tables.table import RoutingTable

from helpers.common import free_port
from helpers.k8s import kubectl, wait_for

pytestmark = pytest.mark.elastic

NS, NAME = "default", "srv-table-watch"


def write(info, version: int, experts: list[int], endpoint: str) -> None:
    layer = min(info.moe_layers)
    reps = tuple(("s1",) if e in experts else ("other",) for e in range(info.num_experts))
    layers = {
        lay: (reps if lay == layer else (("other",),) * info.num_experts) for lay in info.moe_layers
    }
    t = RoutingTable(
        version, info.num_experts, {"s1": endpoint, "other": "tcp://127.0.0.1:1"}, layers
    )
    cm = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": NAME, "namespace": NS},
        "data": {"routing-table.json": t.to_json()},
    }
    kubectl("apply", "-f", "-", input=json.dumps(cm))


def state(url: str) -> dict:
    try:
        return httpx.get(f"{url}/health", timeout=10).json()
    except (httpx.HTTPError, ValueError):
        return {}


def test_server_follows_configmap_and_keeps_two_versions(testbed, tmp_path, model_dir):
    info = read_model_info(model_dir)
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    ep = f"tcp://127.0.0.1:{free_port()}"
    http = free_port()
    url = f"http://127.0.0.1:{http}"
    server = subprocess.Popen(
        [sys.executable, "-m", "eaas", "expert-server", "--model", model_dir]
        + ["--server-id", "s1", "--listen", ep, "--http-port", str(http)]
        + ["--http-host", "127.0.0.1", "--routing-table-configmap", f"{NS}/{NAME}"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "server.log", "w"),
    )
    try:
        wait_for("server up, empty", lambda: state(url).get("experts") == 0, timeout=120)
        write(info, 1, [0, 1, 2, 3], ep)
        rt = lambda: state(url).get("routing_table") or {}  # noqa: E731
        wait_for("version 1 loaded", lambda: rt().get("weights_version") == 1, timeout=60)
        assert state(url)["experts"] == 4
        write(info, 2, [4, 5], ep)
        wait_for("version 2 loaded", lambda: rt().get("weights_version") == 2, timeout=60)
        assert state(url)["experts"] == 6  # version 1's experts kept: clients may still use it
        write(info, 1, [9], ep)  # older: ignored
        write(info, 3, [4, 5], ep)
        wait_for("version 3 applied", lambda: rt().get("weights_version") == 3, timeout=60)
        wait_for("version 1's experts dropped", lambda: state(url).get("experts") == 2, timeout=60)
        assert rt()["assigned_version"] == 3 and rt()["released_version"] == 2
        assert state(url)["status"] == "ok"
    finally:
        server.terminate()
        try:
            server.wait(15)
        except subprocess.TimeoutExpired:
            server.kill()
        kubectl("delete", "configmap", NAME, "-n", NS, check=False)
