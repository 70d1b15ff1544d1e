"""The record of a running testbed (``<state-dir>/testbed.json``: pids, ports, paths) and the
admin's HTTPS calls to its apiserver."""

from __future__ import annotations

import http.client
import json
import os
import shlex
import ssl
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from . import binaries as _build
from .procs import pid_alive

STATE_FILE = "testbed.json"


class TestbedError(RuntimeError):
    """The testbed failed to start, or a component died; the message names the log file."""

    __test__ = False  # not a pytest test class


@dataclass
class Testbed:
    """A running testbed, as recorded in ``<state_dir>/testbed.json``."""

    __test__ = False

    state_dir: Path
    bin_dir: Path
    kubeconfig: Path
    apiserver_url: str
    ports: dict = field(default_factory=dict)
    pids: dict = field(default_factory=dict)
    gpu_nodes: list = field(default_factory=list)
    cpu_nodes: list = field(default_factory=list)
    #: nodes run by a node agent (pods really run); the rest are kwok nodes
    process_nodes: list = field(default_factory=list)
    #: node -> pid of its running agent
    agents: dict = field(default_factory=dict)
    #: node agent settings (restart_backoff_s, volume_sync_s), reused by ``node start``
    agent_settings: dict = field(default_factory=dict)
    #: second octet of the pod IPs (127.<pod_net>.<node>.<n>), unique among live testbeds
    pod_net: int = 1

    def env(self, base: dict | None = None) -> dict:
        """A copy of ``base`` (default ``os.environ``) with KUBECONFIG and PATH pointing here."""
        env = dict(os.environ if base is None else base)
        env["KUBECONFIG"] = str(self.kubeconfig)
        env["PATH"] = f"{self.bin_dir}{os.pathsep}{env.get('PATH', '')}"
        return env

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess:
        """Run this testbed's kubectl; returns the CompletedProcess (text mode)."""
        return subprocess.run(
            [str(self.bin_dir / "kubectl"), *args],
            env=self.env(),
            input=input,
            capture_output=True,
            text=True,
            check=check,
            timeout=timeout,
        )

    def to_json(self) -> dict:
        return {
            "state_dir": str(self.state_dir),
            "bin_dir": str(self.bin_dir),
            "kubeconfig": str(self.kubeconfig),
            "apiserver_url": self.apiserver_url,
            "ports": self.ports,
            "pids": self.pids,
            "gpu_nodes": self.gpu_nodes,
            "cpu_nodes": self.cpu_nodes,
            "process_nodes": self.process_nodes,
            "agents": self.agents,
            "agent_settings": self.agent_settings,
            "pod_net": self.pod_net,
        }

    @classmethod
    def from_json(cls, d: dict) -> Testbed:
        return cls(
            state_dir=Path(d["state_dir"]),
            bin_dir=Path(d["bin_dir"]),
            kubeconfig=Path(d["kubeconfig"]),
            apiserver_url=d["apiserver_url"],
            ports=d["ports"],
            pids=d["pids"],
            gpu_nodes=d.get("gpu_nodes", []),
            cpu_nodes=d.get("cpu_nodes", []),
            process_nodes=d.get("process_nodes", []),
            agents=d.get("agents", {}),
            agent_settings=d.get("agent_settings", {}),
            pod_net=d.get("pod_net", 1),
        )

    def save(self) -> None:
        (self.state_dir / STATE_FILE).write_text(json.dumps(self.to_json(), indent=2))


def default_state_dir() -> Path:
    """``~/.cache/eaas/testbed/run`` (or under ``$EAAS_CACHE_DIR``)."""
    return _build.cache_root() / "run"


def load(state_dir: Path | None = None) -> Testbed | None:
    """The testbed recorded in ``state_dir``, or None if there is no record."""
    p = Path(state_dir or default_state_dir()) / STATE_FILE
    if not p.is_file():
        return None
    return Testbed.from_json(json.loads(p.read_text()))


def require(state_dir: Path | None) -> Testbed:
    """The testbed recorded in ``state_dir``.

    Raises:
        TestbedError: no testbed is recorded there.
    """
    tb = load(state_dir)
    if tb is None:
        raise TestbedError(
            f"no testbed in {state_dir or default_state_dir()}; run `eaas testbed up` first"
        )
    return tb


def ssl_context(pki_dir: Path) -> ssl.SSLContext:
    """TLS context of the testbed's admin: its CA and admin client certificate."""
    ctx = ssl.create_default_context(cafile=str(pki_dir / "ca.crt"))
    ctx.load_cert_chain(str(pki_dir / "admin.crt"), str(pki_dir / "admin.key"))
    return ctx


def api(
    tb: Testbed, method: str, path: str, body: dict | None = None, timeout: float = 10
) -> tuple[int, dict | str]:
    """One HTTPS request to the testbed apiserver as admin. Returns (status, parsed body)."""
    ctx = ssl_context(tb.state_dir / "pki")
    conn = http.client.HTTPSConnection(
        "127.0.0.1", tb.ports["apiserver"], context=ctx, timeout=timeout
    )
    try:
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read().decode()
        try:
            return resp.status, json.loads(raw)
        except ValueError:
            return resp.status, raw
    finally:
        conn.close()


def healthy(tb: Testbed) -> bool:
    """All recorded processes alive and the apiserver answers ``/readyz`` with 200."""
    if not all(pid_alive(pid, name) for name, pid in tb.pids.items()):
        return False
    try:
        status, _ = api(tb, "GET", "/readyz", timeout=5)
    except OSError:
        return False
    return status == 200


def env_lines(state_dir: Path | None = None) -> str:
    """Shell lines exporting KUBECONFIG and PATH for the testbed in ``state_dir``.

    Raises:
        TestbedError: no testbed is recorded there.
    """
    tb = require(state_dir)
    return (
        f"export KUBECONFIG={shlex.quote(str(tb.kubeconfig))}\n"
        f'export PATH={shlex.quote(str(tb.bin_dir))}:"$PATH"\n'
    )
