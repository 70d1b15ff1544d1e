"""``eaas serve`` as the local monitor, tried as a new user would: started from a folder that
holds an ``eaas/`` directory of its own (a checkout, a project named so) with the ``eaas``
console script; a healthy start logs in one format and warns about nothing; an expert server
that dies (SIGKILL) is started again with back-off and put back into the routing table, while
completions through the official ``openai`` client keep working throughout; an attention client
that dies is started again too and serves the same completions.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from eaas.runtime.tables.table import RoutingTable

from helpers.dispatch import wait_all_connected
from helpers.e2e import ServeProcess, descendants, free_port

pytestmark = pytest.mark.api

#: the first lines of a decoy package: importing it fails loudly
DECOY = 'raise ImportError("the eaas/ folder of the working directory was imported")\n'
#: every line of serve's output: time stamp, [source], message
LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \[[^\]]+\] ")


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("folder-with-eaas")
    (cwd / "eaas").mkdir()
    (cwd / "eaas" / "__init__.py").write_text(DECOY)
    (cwd / "eaas" / "__main__.py").write_text(DECOY)
    script = Path(sys.executable).with_name("eaas")  # the console script of this install
    assert script.exists(), f"no eaas console script next to {sys.executable}"
    sp = ServeProcess(
        ["--expert-servers", "3", "--replicas", "2", "--dispatch-timeout", "5"],
        tmp_path_factory.mktemp("serve-monitor") / "serve.log",
        free_port(),
        command=[str(script)],
        cwd=cwd,
    )
    sp.start()
    yield sp
    sp.stop(check=True)


def _health(sp: ServeProcess) -> dict:
    return httpx.get(f"{sp.base_url}/health", timeout=10).json()


def _server_pid(sp: ServeProcess, server_id: str) -> int | None:
    for pid, cmd in descendants(sp.proc.pid).items():
        if f"--server-id {server_id} " in cmd + " ":
            return pid
    return None


def _greedy_completion(sp: ServeProcess, prompt: str):
    """A function that returns the text of 8 greedy tokens after ``prompt`` (official client,
    no retries: a failed request raises)."""
    client = openai.OpenAI(base_url=f"{sp.base_url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id

    def complete() -> str:
        r = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
        return r.choices[0].text

    return complete


def test_healthy_start_from_a_folder_with_eaas_in_it(deployment):
    """The children run the installed package (``python -P -m eaas``), not the folder's decoy;
    every output line has the one format; a server not reached yet is no warning."""
    wait_all_connected(lambda: _health(deployment))
    log = deployment.log()
    assert "the eaas/ folder of the working directory was imported" not in log, log[-3000:]
    cmds = descendants(deployment.proc.pid).values()
    assert sum(" -P -m eaas expert-server " in c for c in cmds) == 3, cmds
    bad = [line for line in log.splitlines() if not LINE.match(line)]
    assert not bad, bad[:20]
    # a server not reached yet may be noted (at info, no WARNING prefix), never as a failure
    early = [line for line in log.splitlines() if "marked down" in line]
    assert all("not reached yet" in line for line in early), early
    assert "WARNING" not in log, log[-3000:]
    assert "(3 expert servers, 2 replicas, 1 client)" in log


def test_killed_expert_server_restarts_and_rejoins_the_table(deployment):
    sp = deployment
    complete = _greedy_completion(sp, "A routing table maps every logical expert")
    reference = complete()
    results: list[tuple[float, str | BaseException]] = []
    stop = threading.Event()

    def load() -> None:  # completions throughout the kill, the restart and the rejoin
        while not stop.is_set():
            try:
                results.append((time.monotonic(), complete()))
            except Exception as exc:  # noqa: BLE001  (asserted below)
                results.append((time.monotonic(), exc))

    before = _health(sp)
    wait_all_connected(lambda: _health(sp))
    victim = _server_pid(sp, "expert-1")
    assert victim is not None
    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    try:
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        # restarted: a new process for expert-1
        deadline = time.monotonic() + 120
        while (pid := _server_pid(sp, "expert-1")) in (None, victim):
            assert time.monotonic() < deadline, sp.log()[-3000:]
            time.sleep(0.2)
        # back in the table: a newer version than the one without it, with expert-1 serving
        deadline = time.monotonic() + 180
        while True:
            h = _health(sp)
            back = h["routing_table_version"] >= before["routing_table_version"] + 2
            if back and h["servers"].get("expert-1", {}).get("state") == "connected":
                break
            assert time.monotonic() < deadline, (h, sp.log()[-3000:])
            time.sleep(0.2)
        rejoined_at = time.monotonic()
        time.sleep(2)  # completions after the rejoin too
    finally:
        stop.set()
        worker.join(120)
    assert not worker.is_alive()
    table = RoutingTable.from_json((sp.run_dir / "routing-table.json").read_text())
    assert table.version == h["routing_table_version"]
    assert table.hosted_by("expert-1") and "expert-1" in table.servers
    assert _server_pid(sp, "expert-1") == pid != victim
    failed = [r for _, r in results if not isinstance(r, str)]
    assert not failed, failed[:3]
    assert all(r == reference for _, r in results), results
    assert any(killed_at < t < rejoined_at for t, _ in results), "no completion while it was out"
    assert any(t > rejoined_at for t, _ in results)
    log = sp.log()
    assert re.search(
        r"expert server expert-1 \(pid \d+\) exited with code -9; routing table "
        r"version \d+ leaves it out; clients send its tokens to the other "
        r"replicas; restarting it in 1 s",
        log,
    ), log[-3000:]
    assert f"restarted expert server expert-1 (pid {pid}, restart 1)" in log, log[-3000:]
    assert re.search(
        rf"expert server expert-1 \(pid {pid}\) serves again: routing table "
        rf"version {table.version} has it back",
        log,
    ), log[-3000:]


def _client_pid(sp: ServeProcess) -> int | None:
    for pid, cmd in descendants(sp.proc.pid).items():
        if " -m eaas attention-client " in cmd + " ":
            return pid
    return None


def test_killed_attention_client_restarts_and_serves_again(deployment):
    """The deployment's only attention client SIGKILLed: serve stays up, starts it again with
    the same command line after its back-off, and the new client serves the same greedy
    completion as before."""
    sp = deployment
    complete = _greedy_completion(sp, "Kubernetes schedules pods on nodes")
    reference = complete()
    victim = _client_pid(sp)
    assert victim is not None
    argv_before = descendants(sp.proc.pid)[victim]
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while (pid := _client_pid(sp)) in (None, victim):
        assert sp.proc.poll() is None, sp.log()[-3000:]  # serve did not exit
        assert time.monotonic() < deadline, sp.log()[-3000:]
        time.sleep(0.2)
    deadline = time.monotonic() + 180
    while True:  # the new process binds the port once it loaded the model
        try:
            if httpx.get(f"{sp.base_url}/health", timeout=10).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, sp.log()[-3000:]
        time.sleep(0.5)
    assert complete() == reference
    assert descendants(sp.proc.pid)[pid] == argv_before  # the same command line
    log = sp.log()
    assert re.search(
        rf"attention client attention-client-0 \(pid {victim}\) exited with code -9: its "
        r"running requests ended; restarting it in 1 s",
        log,
    ), log[-3000:]
    assert f"restarted attention client attention-client-0 (pid {pid}, restart 1)" in log
