"""Probes of a process node's containers: one run of an httpGet, tcpSocket or exec probe."""

from __future__ import annotations

import http.client
import json
import os
import socket
import ssl
import subprocess
import sys
from pathlib import Path

from . import pod as podlogic
from .containers import PODINIT, Ctr, Probe


def run_probe(c: Ctr, p: Probe, pod_ip: str, pod_dir: Path) -> tuple[bool, str]:
    """Run probe ``p`` of container ``c`` once (httpGet, tcpSocket, or exec inside the
    container through podinit); returns (success, message on failure)."""
    s = p.spec
    timeout = float(s["timeoutSeconds"])
    try:
        if "httpGet" in s:
            h = s["httpGet"]
            host = h.get("host") or pod_ip
            port = podlogic.resolve_port(c.spec, h["port"])
            if h.get("scheme", "HTTP").upper() == "HTTPS":
                ctx = ssl._create_unverified_context()
                conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                    host, port, timeout=timeout, context=ctx
                )
            else:
                conn = http.client.HTTPConnection(host, port, timeout=timeout)
            try:
                headers = {x["name"]: x["value"] for x in h.get("httpHeaders") or []}
                headers.setdefault("User-Agent", "kube-probe/testbed")
                conn.request("GET", h.get("path", "/"), headers=headers)
                r = conn.getresponse()
                r.read()
                return 200 <= r.status < 400, f"HTTP probe failed with statuscode: {r.status}"
            finally:
                conn.close()
        if "tcpSocket" in s:
            t = s["tcpSocket"]
            port = podlogic.resolve_port(c.spec, t["port"])
            with socket.create_connection((t.get("host") or pod_ip, port), timeout=timeout):
                return True, ""
        if "exec" in s:
            if c.proc is None:
                return False, "container not running"
            ispec = {
                "argv": s["exec"]["command"],
                "env": c.env,
                "cwd": c.spec.get("workingDir") or "/",
                "mounts": [],
                "enter_pid": c.proc.pid,
                "agent_pid": os.getpid(),
            }
            path = pod_dir / f".probe-{c.name}.json"
            path.write_text(json.dumps(ispec))
            done = subprocess.run(
                [sys.executable, "-I", PODINIT, str(path)],
                capture_output=True,
                timeout=timeout + 1.0,  # + podinit start-up
                env={"PATH": c.env.get("PATH", "/usr/bin:/bin")},
            )
            out = (done.stdout + done.stderr).decode(errors="replace")[-300:]
            return done.returncode == 0, f"exec probe exited {done.returncode}: {out}"
    except (OSError, subprocess.TimeoutExpired, http.client.HTTPException) as e:
        return False, f"{p.kind} probe failed: {e}"
    except podlogic.PodConfigError as e:
        return False, str(e)
    return False, "unsupported probe"
