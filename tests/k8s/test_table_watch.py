"""An attention client converges from the routing-table ConfigMap through the API server
(``--routing-table-configmap``), against the testbed's real kube-apiserver.

One client, started before the ConfigMap exists (``/health`` 503 "no routing table yet"), picks
up version 1 when it is created, then a higher version, skips a malformed one, and -- frozen with
SIGSTOP while version 5 is written, so it missed any push -- holds version 5 after SIGCONT. A second
client started afterwards begins with version 5. Every step ends with a completion whose greedy
tokens equal the first one's.

Bound stated (and asserted): each change applied within 30 s. Measured on the loaded 2-core
machine: write -> applied 0.03-0.07 s, SIGCONT -> caught up 0.04-0.05 s (the watch event).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from eaas.runtime.models.arch import read_model_info
from eaas.runtime.tables.table import RoutingTable

from helpers.common import free_port
from helpers.e2e import greedy_token_ids
from helpers.k8s import kubectl, wait_for

pytestmark = pytest.mark.cluster

BOUND_S = 30.0
NS, NAME = "default", "rt-watch"


def write_configmap(text: str) -> None:
    cm = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": NAME, "namespace": NS},
        "data": {"routing-table.json": text},
    }
    kubectl("apply", "-f", "-", input=json.dumps(cm))


def table(info, version: int, sid: str, endpoint: str) -> str:
    layers = {layer: ((sid,),) * info.num_experts for layer in info.moe_layers}
    return RoutingTable(version, info.num_experts, {sid: endpoint}, layers).to_json()


def version(url: str) -> int | None:
    try:
        return httpx.get(f"{url}/routing-table", timeout=10).json()["version"]
    except httpx.HTTPError:
        return None


def complete(url: str) -> list[int]:
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
    return greedy_token_ids(c, "tiny", "Stateless experts", 5)


def test_client_follows_configmap_through_the_api(testbed, tmp_path, model_dir):
    info = read_model_info(model_dir)
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    ep = f"tcp://127.0.0.1:{free_port()}"
    server = subprocess.Popen(
        [sys.executable, "-m", "eaas", "expert-server", "--model", model_dir]
        + ["--server-id", "a", "--listen", ep],
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    kubectl("delete", "configmap", NAME, "-n", NS, "--ignore-not-found")
    clients: list[subprocess.Popen] = []
    log = open(tmp_path / "client.log", "w+")

    def start_client() -> tuple[subprocess.Popen, str, str]:
        port = free_port()
        p = subprocess.Popen(
            [sys.executable, "-m", "eaas", "attention-client", "--model", model_dir]
            + ["--port", str(port), "--served-model-name", "tiny"]
            + ["--routing-table-configmap", f"{NS}/{NAME}"],
            stdout=subprocess.PIPE,
            stderr=log,
            env=env,  # KUBECONFIG of the testbed (set by the fixture)
            text=True,
        )
        clients.append(p)
        line = p.stdout.readline()
        log.seek(0)
        assert " ready on " in line, f"{line!r}\n{log.read()[-3000:]}"
        return p, f"http://127.0.0.1:{port}", line

    try:
        assert " ready on " in server.stdout.readline()
        # started before the ConfigMap exists: serves nothing, says so, and picks it up
        client, url, line = start_client()
        assert "routing table v0" in line
        h = httpx.get(f"{url}/health", timeout=10)
        assert h.status_code == 503 and h.json()["reason"] == "no routing table yet"
        write_configmap(table(info, 1, "a", ep))
        wait_for("version 1 once the ConfigMap exists", lambda: version(url) == 1, BOUND_S)
        reference = complete(url)

        # a later, higher version written to the ConfigMap is applied
        write_configmap(table(info, 2, "a2", ep))
        t0 = time.monotonic()
        wait_for("version 2 from the ConfigMap", lambda: version(url) == 2, timeout=BOUND_S)
        print(f"ConfigMap write -> applied: {time.monotonic() - t0:.2f} s")
        got = httpx.get(f"{url}/routing-table", timeout=10).json()
        assert got["servers"] == {"a2": ep}
        assert complete(url) == reference

        # a malformed table is skipped (the table in use stays); the next valid one applies
        write_configmap('{"version": 3, "layers": ')
        write_configmap(table(info, 4, "a4", ep))
        wait_for("version 4 after a bad one", lambda: version(url) == 4, timeout=BOUND_S)

        # frozen while version 5 is written (it misses every push): catches up on resume
        os.kill(client.pid, signal.SIGSTOP)
        try:
            write_configmap(table(info, 5, "a5", ep))
        finally:
            os.kill(client.pid, signal.SIGCONT)
        t0 = time.monotonic()
        wait_for("version 5 after SIGCONT", lambda: version(url) == 5, timeout=BOUND_S)
        print(f"resume -> caught up: {time.monotonic() - t0:.2f} s")
        assert complete(url) == reference
        h = httpx.get(f"{url}/health", timeout=10).json()
        assert h["routing_table_version"] == 5 and h["status"] == "ok"

        # a client that was not running at all starts with the ConfigMap's version
        _, url2, line = start_client()
        assert "routing table v5" in line and version(url2) == 5
        assert complete(url2) == reference
    finally:
        for p in clients:
            os.kill(p.pid, signal.SIGCONT)
        for p in (*clients, server):
            p.terminate()
        for p in (*clients, server):
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        log.close()
        kubectl("delete", "configmap", NAME, "-n", NS, "--ignore-not-found", check=False)
