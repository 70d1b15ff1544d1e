"""Helpers shared by the tests (``tests/k8s``, ``tests/cluster``) and ``bench/`` scripts that
drive the testbed with ``kubectl`` (resolved via PATH and KUBECONFIG, which the ``testbed`` /
``cluster`` fixtures point at the testbed): kubectl and JSON reads, state waits, the CRDs, the
operator as a child process, and the testbed fixtures' common start and stop
(:func:`running_testbed`)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from eaas.runtime.tables.expert_spec import parse_expert_spec
from eaas.runtime.tables.table import RoutingTable

from helpers.common import free_port

ROOT = Path(__file__).resolve().parents[2]
TINY = yaml.safe_load((ROOT / "deploy/examples/tiny-pool.yaml").read_text())
FLEET = yaml.safe_load((ROOT / "deploy/examples/tiny-fleet.yaml").read_text())
TINY_LAYERS = [1, 2, 3]


def kubectl(
    *args: str, input: str | None = None, check: bool = True
) -> subprocess.CompletedProcess:
    """Run kubectl; with ``check``, a non-zero exit fails the test with kubectl's stderr."""
    r = subprocess.run(["kubectl", *args], input=input, capture_output=True, text=True, timeout=60)
    if check and r.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)} failed: {r.stderr}")
    return r


def get_json(*args: str) -> dict:
    return json.loads(kubectl("get", *args, "-o", "json").stdout)


def get(kind: str, name: str, ns: str) -> dict | None:
    """The object as JSON, or None when kubectl cannot get it (absent)."""
    r = kubectl("get", kind, name, "-n", ns, "-o", "json", check=False)
    return json.loads(r.stdout) if r.returncode == 0 else None


def wait_for(what: str, fn, timeout: float = 60.0, interval: float = 0.2):
    """Poll ``fn`` until it returns a truthy value (returned); fail with ``what`` after ``timeout``
    s (``pytest.fail`` under pytest; ``TimeoutError`` in a bench script without pytest)."""
    end = time.monotonic() + timeout
    last = None
    while time.monotonic() < end:
        last = fn()
        if last:
            return last
        time.sleep(interval)
    msg = f"timed out after {timeout}s waiting for {what}; last: {str(last)[:2000]}"
    try:
        import pytest
    except ImportError:
        raise TimeoutError(msg) from None
    pytest.fail(msg)


def apply_crds() -> None:
    """Apply the committed CRDs (``deploy/crds``) and wait until the API server serves them."""
    kubectl("apply", "-f", str(ROOT / "deploy/crds"))
    for crd in ("expertpools.eaas.io", "attentionfleets.eaas.io"):
        kubectl("wait", "--for=condition=Established", f"crd/{crd}", "--timeout=60s")


def wait_namespaces_deleted(timeout: float = 180.0) -> None:
    """Wait until the namespaces being deleted hold no pod, ExpertPool or AttentionFleet any
    more: their processes are gone (GPUs and pod IPs free) and the pools' finalizers were
    removed by the operator (call it while the operator still runs). It deletes their pools
    and fleets itself first (the namespace controller would, ~10 s later). The namespace
    objects themselves finish later without the operator. The ``cluster`` tier shares one testbed
    between modules, so a module leaves nothing running for the next."""

    def terminating_namespaces() -> set[str]:
        return {
            n["metadata"]["name"]
            for n in get_json("namespaces")["items"]
            if n["status"].get("phase") == "Terminating"
        }

    # Measured on the testbed: the namespace controller marks the pools and fleets deleted
    # about 10 s after the pods (meanwhile the pool's daemon tries to re-create its pods and
    # is refused, 403). Delete them now: the operator drops their finalizers while the pods go
    # (namespace emptied in ~1 s instead of ~11 s).
    for ns in sorted(terminating_namespaces()):
        kubectl(
            "delete", "expertpools,attentionfleets", "--all", "-n", ns, "--wait=false", check=False
        )

    def emptied():
        terminating = terminating_namespaces()
        if not terminating:
            return True
        left = [
            f"{o['kind']} {o['metadata']['namespace']}/{o['metadata']['name']}"
            for o in get_json("pods,expertpools,attentionfleets", "-A")["items"]
            if o["metadata"]["namespace"] in terminating
        ]
        return not left or None

    wait_for("deleted namespaces emptied", emptied, timeout=timeout, interval=0.5)


def pod_ready(pod: dict) -> bool:
    """Whether the pod's Ready condition is True."""
    return any(
        c["type"] == "Ready" and c["status"] == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


def routing_table(ns: str, pool: str) -> Any:
    """The pool's published routing table (:class:`eaas.runtime.tables.table.RoutingTable`, from
    its ConfigMap ``<pool>-routing-table``), or None before there is one."""
    from eaas.runtime.tables.table import RoutingTable

    cm = get("configmap", f"{pool}-routing-table", ns)
    return RoutingTable.from_json(cm["data"]["routing-table.json"]) if cm else None


def server_pods(ns: str, pool: str | None = None, terminating: bool = False) -> dict[str, dict]:
    """Expert-server pods (of ``pool``, else of every pool in ``ns``) by name; those being
    deleted only with ``terminating``."""
    sel = "eaas.io/role=expert-server" + (f",eaas.io/pool={pool}" if pool else "")
    items = get_json("pods", "-n", ns, "-l", sel)["items"]
    return {
        p["metadata"]["name"]: p
        for p in items
        if terminating or not p["metadata"].get("deletionTimestamp")
    }


def client_pods(ns: str, fleet: str) -> list[dict]:
    """The fleet's attention-client pods not being deleted, sorted by name."""
    items = get_json("pods", "-n", ns, "-l", f"eaas.io/fleet={fleet}")["items"]
    return sorted(
        (p for p in items if not p["metadata"].get("deletionTimestamp")),
        key=lambda p: p["metadata"]["name"],
    )


# ---- the tiny pool of deploy/examples and what the operator made of it ---------------------------
def pods(ns: str, pool: str) -> list[dict]:
    """The expert-server pods of ``pool`` in ``ns`` (JSON objects)."""
    out = kubectl(
        "get",
        "pods",
        "-n",
        ns,
        "-l",
        f"eaas.io/pool={pool},eaas.io/role=expert-server",
        "-o",
        "json",
    ).stdout
    return json.loads(out)["items"]


def table(ns: str, pool: str) -> RoutingTable | None:
    """The routing table of ``pool``'s ConfigMap, or None while there is none."""
    cm = get("configmap", f"{pool}-routing-table", ns)
    return RoutingTable.from_json(cm["data"]["routing-table.json"]) if cm else None


def pool_manifest(name: str, **spec) -> dict:
    """The tiny ExpertPool of deploy/examples named ``name``, ``spec`` fields replaced."""
    m = json.loads(json.dumps(TINY))
    m["metadata"]["name"] = name
    m["spec"].update(spec)
    return m


def apply(obj: dict, ns: str, check: bool = True) -> subprocess.CompletedProcess:
    """``kubectl apply`` of ``obj`` in ``ns``."""
    return kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(obj), check=check)


def converged(ns: str, name: str) -> dict | None:
    """The pool when status, pods and routing table all agree on a Ready pool; else None.

    Checks: Ready condition True for the current generation; exactly ``<name>-0..N-1`` exist,
    all Running+Ready with an IP; the ConfigMap table lists exactly those pods with their
    endpoints, covers every (layer, expert) with ``redundancy`` distinct live servers, each of
    which really hosts it (its ``--experts``); status.routingTableVersion == table version.
    """
    pool = get("expertpool", name, ns)
    if not pool:
        return None
    st = pool.get("status") or {}
    if st.get("observedGeneration") != pool["metadata"]["generation"]:
        return None
    if not any(c["type"] == "Ready" and c["status"] == "True" for c in st.get("conditions", [])):
        return None
    n, r, port = pool["spec"]["replicas"], pool["spec"]["redundancy"], pool["spec"]["port"]
    ps = [p for p in pods(ns, name) if not p["metadata"].get("deletionTimestamp")]
    names = sorted(p["metadata"]["name"] for p in ps)
    if names != sorted(f"{name}-{i}" for i in range(n)):
        return None
    hosted = {}
    for p in ps:
        if p["status"].get("phase") != "Running" or not p["status"].get("podIP"):
            return None
        cmd = p["spec"]["containers"][0]["command"]
        hosted[p["metadata"]["name"]] = (
            set(parse_expert_spec(cmd[cmd.index("--experts") + 1])),
            f"tcp://{p['status']['podIP']}:{port}",
        )
    t = table(ns, name)
    if t is None or st.get("routingTableVersion") != t.version:
        return None
    if dict(t.servers) != {k: v[1] for k, v in hosted.items()}:
        return None
    model = pool["spec"]["model"]
    layers = range(model["firstMoeLayer"], model["firstMoeLayer"] + model["numMoeLayers"])
    assert sorted(t.layers) == list(layers)
    for layer in layers:
        for e in range(model["numExperts"]):
            reps = t.replicas(layer, e)
            assert len(set(reps)) == len(reps) >= r, (
                f"expert ({layer},{e}) has replicas {reps}, want {r}"
            )
            for s in reps:
                assert (layer, e) in hosted[s][0], (
                    f"table says {s} hosts ({layer},{e}) but it does not"
                )
    assert st["readyReplicas"] == n and st["replicas"] == n
    assert (
        st["placement"]["expertsBelowRedundancy"] == 0 and st["placement"]["uncoveredExperts"] == 0
    )
    return {"pool": pool, "pods": ps, "table": t}


class Operator:
    """``eaas operator`` as a child process (resync 1 s, Lease 3 s); logs go to ``log_path``;
    ``env`` adds to (or overrides) the test environment."""

    def __init__(self, log_path: Path, env: dict[str, str] | None = None):
        self.log_path = log_path
        self.extra_env = env or {}
        self.proc: subprocess.Popen | None = None
        self._offset, self._port = 0, 0  # log offset and liveness port of the last spawn

    def start(self) -> None:
        """Start it and wait until it serves its liveness probe and watches pools and pods."""
        self.spawn()
        self.wait_ready()

    def spawn(self) -> None:
        """Start the process without waiting (:meth:`wait_ready` waits): several operators
        start side by side."""
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        log = open(self.log_path, "a")
        port = free_port()
        env = {
            **os.environ,
            "EAAS_OPERATOR_RESYNC_S": "1",
            "EAAS_OPERATOR_WATCH_TIMEOUT_S": "30",
            # a SIGKILLed operator's successor waits out the Lease: keep that short in tests
            "EAAS_OPERATOR_LEASE_DURATION_S": "3",
            **self.extra_env,
        }
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "eaas.cli",
                "operator",
                "--verbose",
                f"--liveness=http://127.0.0.1:{port}/healthz",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        self._offset, self._port = offset, port

    def wait_ready(self) -> None:
        """Wait until the spawned operator serves its liveness probe and watches pools and
        pods (fails with its log if it exits)."""
        offset, port = self._offset, self._port

        def ready():
            assert self.proc is not None
            assert self.proc.poll() is None, f"operator exited: {self.log_path.read_text()[-3000:]}"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1).read()
            except OSError:
                return False
            text = self.log_path.read_text()[offset:]
            return all(
                f"Starting the watch-stream for {r}" in text for r in ("expertpools", "pods.v1")
            )

        wait_for("operator ready", ready, timeout=60)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()

    def alive(self) -> bool:
        return bool(self.proc) and self.proc.poll() is None


@contextlib.contextmanager
def running_testbed(tmp_path_factory: Any, label: str, **up: Any) -> Iterator[Any]:
    """A private testbed (``eaas.testbed.up(attached=True, **up)`` in a fresh temp state dir)
    with ``KUBECONFIG`` and ``PATH`` pointing at it in ``os.environ`` while the block runs.

    At exit: the environment is restored, the testbed stopped, its component logs (and the
    process nodes' pod logs) kept under ``<basetemp>/<label>-logs`` for post-mortems, its state
    dir removed; then it fails if any process outlived ``down`` (an agent, a container, an
    escaped descendant). Without testbed binaries and no way to build them, the test fails
    with the build error (never skipped: a green run means a real API server was used).
    """
    import pytest

    from eaas import testbed as tbmod
    from eaas.testbed.cluster import STATE_MARKER
    from eaas.testbed.procs import agent_alive, find_marked

    if tbmod.find_bin_dir() is None:
        try:
            tbmod.binaries.go_binary()
        except tbmod.BuildError as e:
            pytest.fail(f"testbed binaries unavailable (run `eaas testbed build`): {e}")
    state_dir = tmp_path_factory.mktemp(label) / "state"
    tb = tbmod.up(state_dir=state_dir, timeout=300, attached=True, **up)
    saved = {k: os.environ.get(k) for k in ("KUBECONFIG", "PATH")}
    os.environ.update({k: tb.env()[k] for k in ("KUBECONFIG", "PATH")})
    try:
        yield tb
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        agents = dict(tbmod.load(state_dir).agents)
        tbmod.down(state_dir=state_dir, remove=False)
        leaked = [p for p in agents.values() if agent_alive(p)]
        leaked += find_marked(STATE_MARKER, str(tb.state_dir))
        keep = tmp_path_factory.getbasetemp() / f"{label}-logs"
        shutil.copytree(state_dir / "logs", keep, dirs_exist_ok=True)
        for log in (state_dir / "nodes").glob("*/pods/*/*.log"):
            dest = keep / "pods" / log.parent.name
            dest.mkdir(parents=True, exist_ok=True)
            shutil.copy(log, dest)
        shutil.rmtree(state_dir, ignore_errors=True)
        assert not leaked, f"processes left after `eaas testbed down`: {leaked}"
