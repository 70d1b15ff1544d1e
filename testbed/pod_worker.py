"""One pod on a process node: its init and main containers as local processes (through
:mod:`.podinit`), probes, restarts with the kubelet's back-off, termination and deletion, and
the pod's status."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

from kubernetes.client.rest import ApiException

from . import pod as podlogic
from .containers import (
    BACKOFF_RESET_S,
    IMAGE_ENV,
    MAX_BACKOFF_S,
    PODINIT,
    Ctr,
    Probe,
    exit_code,
    killpg,
)
from .node import HOST_IP, Node, now_iso
from .probes import run_probe
from .procs import CONTAINER_MARKER, POD_MARKER, STATE_MARKER, kill_marked
from .volumes import PodVolumes

log = logging.getLogger("eaas.testbed.agent")

#: A pod's status whose API copy differs from what the agent observes
#: (:func:`.pod.status_drift`) is written again at most once per this many seconds (s). The
#: watch delivers the overwrite at once and the pod loop runs every 0.1 s, so a pod's status is
#: back within about this bound of the overwrite (a kubelet: its status sync, ~10 s).
REASSERT_MIN_S = 1.0


class PodWorker(threading.Thread):
    """Runs one pod until it is deleted. Spawns its containers itself, and lives as long as
    they do (PR_SET_PDEATHSIG follows the spawning thread)."""

    def __init__(self, node: Node, pod: dict):
        meta = pod["metadata"]
        super().__init__(name=f"pod-{meta['namespace']}/{meta['name']}", daemon=True)
        self.node = node
        self.pod = pod
        self.uid = meta["uid"]
        self.wake = threading.Event()
        self.gone = False
        self.off = False
        self.dir = node.pods_dir / f"{meta['namespace']}_{meta['name']}_{self.uid[:8]}"
        spec = pod["spec"]
        old = {c["name"]: c for c in (pod.get("status") or {}).get("containerStatuses") or []}
        old.update(
            {c["name"]: c for c in (pod.get("status") or {}).get("initContainerStatuses") or []}
        )
        self.init_ctrs = [Ctr(spec=c, init=True) for c in spec.get("initContainers") or []]
        self.ctrs = [Ctr(spec=c) for c in spec["containers"]]
        for c in self.init_ctrs + self.ctrs:
            prev = old.get(c.name)
            if prev is not None and prev.get("containerID"):
                # resumed after an agent restart: the old process died with the old agent
                c.restart_count = prev.get("restartCount", 0) + 1
        self.pod_ip = ""
        self.config_error: str | None = None
        self.vols = PodVolumes(node, self.dir)
        self.last_status: dict | None = None
        self.last_post = 0.0  # monotonic time of the last status write
        self.cond_times: dict[str, tuple[str, str]] = {}
        self.start_time = (pod.get("status") or {}).get("startTime") or now_iso()
        self.initialized = not self.init_ctrs

    # -- called from the watch thread ---------------------------------------------------------
    def update(self, pod: dict) -> None:
        self.pod = pod
        self.wake.set()

    def mark_gone(self) -> None:
        self.gone = True
        self.wake.set()

    def power_off(self) -> None:
        self.off = True
        for c in self.init_ctrs + self.ctrs:
            if c.proc is not None:
                killpg(c.proc.pid, signal.SIGKILL)
        self.wake.set()

    # -- main loop ----------------------------------------------------------------------------
    def run(self) -> None:
        try:
            self._run()
        except Exception:
            log.exception("pod worker %s failed", self.name)
            for c in self.init_ctrs + self.ctrs:
                if c.proc is not None:
                    killpg(c.proc.pid, signal.SIGKILL)
                    c.proc.wait()
        finally:
            self.node.release(self.uid)
            if not self.off:  # keep the logs (removed with the state dir at `down`)
                shutil.rmtree(self.dir / "volumes", ignore_errors=True)
                for f in self.dir.glob(".*"):
                    if f.is_file():
                        f.unlink(missing_ok=True)

    @property
    def meta(self) -> dict:
        return self.pod["metadata"]

    def _run(self) -> None:
        status = self.pod.get("status") or {}
        terminal = status.get("phase") in ("Succeeded", "Failed")
        if self.pod["spec"].get("hostNetwork"):
            self.pod_ip = HOST_IP
        else:
            self.pod_ip = self.node.alloc_ip(self.uid, status.get("podIP"))
        self.dir.mkdir(parents=True, exist_ok=True)
        if not terminal and not self.meta.get("deletionTimestamp"):  # a pod being deleted
            try:  # before it started gets no volumes (its namespace may refuse tokens): below
                self.vols.setup(self.pod, self.pod_ip)  # it is finalized at once
            except podlogic.PodConfigError as e:
                self.config_error = str(e)
                self.event("FailedMount", str(e), "Warning")
            except Exception as e:
                if not self.meta.get("deletionTimestamp"):
                    raise  # the agent starts a new worker for the pod later (a retry)
                self.config_error = f"deleted while its volumes were set up: {e}"
        while True:
            if self.off or self.node.stopping.is_set():
                self._reap_all()
                return
            if self.gone:
                self._terminate(grace=2.0)
                return
            if self.meta.get("deletionTimestamp"):
                grace = self.meta.get("deletionGracePeriodSeconds")
                if grace is None:
                    grace = self.pod["spec"].get("terminationGracePeriodSeconds", 30)
                self._terminate(grace=float(grace))
                if not self.off:
                    self._finalize_delete()
                return
            if not terminal:
                self._step()
                if not self.config_error:
                    self.vols.maybe_sync(self.pod, self.pod_ip, self.name)
                self._post_status()
            self.wake.wait(0.1)
            self.wake.clear()

    def event(self, reason: str, message: str, type_: str = "Normal") -> None:
        self.node.event(self.pod, reason, message, type_)

    # -- env references ---------------------------------------------------------------------
    def _lookup(self, kind: str, name: str) -> dict[str, str] | None:
        """configMap or secret ``name`` of the pod's namespace as text (for env references)."""
        data = self.node.config_data(kind, name, self.meta["namespace"])
        if data is None:
            return None
        return {k: v.decode(errors="replace") for k, v in data.items()}

    # -- containers ---------------------------------------------------------------------------
    def _base_env(self, c: Ctr) -> dict[str, str]:
        env = {k: os.environ[k] for k in IMAGE_ENV if k in os.environ}
        venv_bin = os.path.dirname(sys.executable)
        env["PATH"] = f"{venv_bin}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        env["HOSTNAME"] = self.pod["spec"].get("hostname") or self.meta["name"]
        env[STATE_MARKER] = str(self.node.testbed_dir)
        env[POD_MARKER] = self.uid
        env[CONTAINER_MARKER] = self._container_key(c)
        port = str(self.node.apiserver_port)
        env.update(
            {
                "KUBERNETES_SERVICE_HOST": HOST_IP,
                "KUBERNETES_SERVICE_PORT": port,
                "KUBERNETES_SERVICE_PORT_HTTPS": port,
                "KUBERNETES_PORT": f"tcp://{HOST_IP}:{port}",
                "KUBERNETES_PORT_443_TCP": f"tcp://{HOST_IP}:{port}",
                "KUBERNETES_PORT_443_TCP_ADDR": HOST_IP,
                "KUBERNETES_PORT_443_TCP_PORT": port,
                "KUBERNETES_PORT_443_TCP_PROTO": "tcp",
            }
        )
        return env

    def _container_key(self, c: Ctr) -> str:
        return f"{self.uid}/{c.name}/{c.restart_count}"

    def _start(self, c: Ctr) -> None:
        spec = c.spec
        try:
            if self.config_error:
                raise podlogic.PodConfigError(self.config_error)
            env = podlogic.container_env(
                self.pod, spec, self.pod_ip, HOST_IP, self._base_env(c), self._lookup
            )
            argv = podlogic.command_line(spec, env)
            if not self.pod["spec"].get("hostNetwork"):
                env["EAAS_TESTBED_POD_IP"] = self.pod_ip
                pp = env.get("PYTHONPATH")
                env["PYTHONPATH"] = f"{pp}:{self.node.shim_dir}" if pp else str(self.node.shim_dir)
            if self.node.gpu_total:
                gpus = self.node.alloc_gpus(f"{self.uid}/{c.name}", podlogic.gpu_request(spec))
                env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
                env["NVIDIA_VISIBLE_DEVICES"] = ",".join(map(str, gpus)) or "void"
            mounts = self.vols.mounts(spec, env)
            for p in (
                spec.get("startupProbe"),
                spec.get("livenessProbe"),
                spec.get("readinessProbe"),
            ):
                if p and not any(k in p for k in ("httpGet", "tcpSocket", "exec")):
                    raise podlogic.PodConfigError(
                        f"container {c.name!r}: probe kind {sorted(p)} is not supported"
                    )
        except (podlogic.PodConfigError, RuntimeError) as e:
            msg = str(e)
            if c.state.get("waiting", {}).get("message") != msg:
                self.event("Failed", f"Error: {msg}", "Warning")
            c.state = {"waiting": {"reason": "CreateContainerConfigError", "message": msg}}
            c.next_start = time.monotonic() + 2.0
            return
        n = c.restart_count
        ispec = {
            "argv": argv,
            "env": env,
            "cwd": spec.get("workingDir") or "/",
            "mounts": mounts,
            "scratch": str(self.dir / f".scratch-{c.name}"),
            "agent_pid": os.getpid(),
        }
        spec_path = self.dir / f".{c.name}-{n}.json"
        spec_path.write_text(json.dumps(ispec))
        logf = open(self.dir / f"{c.name}-{n}.log", "ab")
        try:
            c.proc = subprocess.Popen(
                [sys.executable, "-I", PODINIT, str(spec_path)],
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
                cwd="/",
                env={"PATH": env["PATH"]},
            )
        finally:
            logf.close()
        c.env = env
        c.container_id = f"process://{self.uid[:8]}-{c.name}-{n}-{c.proc.pid}"
        c.started_at = now_iso()
        c.started_mono = time.monotonic()
        c.ever_started = True
        c.exit_code = None
        c.state = {"running": {"startedAt": c.started_at}}
        c.ready = False
        c.kill_deadline = None
        c.restart_after_kill = True
        now = time.monotonic()
        c.probes = [
            Probe(kind, podlogic.probe_settings(spec[key]), now)
            for kind, key in (
                ("startup", "startupProbe"),
                ("liveness", "livenessProbe"),
                ("readiness", "readinessProbe"),
            )
            if spec.get(key) and not c.init
        ]
        for p in c.probes:
            p.next_due = now + p.spec["initialDelaySeconds"]
        c.started = not any(p.kind == "startup" for p in c.probes)
        self.event("Started", f"Started container {c.name} (pid {c.proc.pid})")

    def _kill(self, c: Ctr, grace: float, reason: str, restart: bool = True) -> None:
        if c.proc is None or c.kill_deadline is not None:
            return
        killpg(c.proc.pid, signal.SIGTERM)
        c.kill_deadline = time.monotonic() + grace
        c.kill_reason = reason
        c.restart_after_kill = restart
        self.event("Killing", f"Stopping container {c.name}: {reason}")

    def _poll(self, c: Ctr, policy: str) -> None:
        if c.proc is None:
            return
        if c.kill_deadline is not None and time.monotonic() > c.kill_deadline:
            killpg(c.proc.pid, signal.SIGKILL)
        rc = c.proc.poll()
        if rc is None:
            return
        killpg(c.proc.pid, signal.SIGKILL)  # whatever it left in its process group
        kill_marked(CONTAINER_MARKER, self._container_key(c))  # ... or outside it
        code = exit_code(rc)
        finished = now_iso()
        term = {
            "exitCode": code,
            "reason": "Completed" if code == 0 else "Error",
            "startedAt": c.started_at,
            "finishedAt": finished,
            "containerID": c.container_id,
        }
        ran = time.monotonic() - c.started_mono
        c.proc = None
        c.exit_code = code
        c.ready = False
        c.started = False
        killed = c.kill_deadline is not None
        c.kill_deadline = None
        restart = (
            c.restart_after_kill and policy != "Never"
            if killed
            else podlogic.should_restart(policy, code)
        )
        if c.init and code == 0:
            restart = False
        if restart:
            c.crashes = 0 if ran > BACKOFF_RESET_S else c.crashes + 1
            delay = podlogic.backoff_s(c.crashes - 1, self.node.restart_backoff_s, MAX_BACKOFF_S)
            c.next_start = time.monotonic() + delay
            c.last_state = {"terminated": term}
            c.state = {
                "waiting": {
                    "reason": "CrashLoopBackOff",
                    "message": f"back-off {delay:g}s restarting failed container={c.name} pod={self.meta['name']}",
                }
            }
            c.restart_count += 1
        else:
            c.state = {"terminated": term}
            c.next_start = float("inf")

    def _probe(self, c: Ctr) -> None:
        if c.proc is None or c.kill_deadline is not None:
            return
        now = time.monotonic()
        has_readiness = False
        for p in c.probes:
            if p.kind == "readiness":
                has_readiness = True
            if p.kind == "startup" and c.started:
                continue
            if p.kind != "startup" and not c.started:
                continue
            if now < p.next_due:
                continue
            ok, msg = run_probe(c, p, self.pod_ip, self.dir)
            p.next_due = time.monotonic() + p.spec["periodSeconds"]
            if ok:
                p.successes += 1
                p.failures = 0
            else:
                p.failures += 1
                p.successes = 0
                self.event("Unhealthy", f"{p.kind.capitalize()} probe failed: {msg}", "Warning")
            if p.kind == "startup":
                if p.successes >= 1:
                    c.started = True
                elif p.failures >= p.spec["failureThreshold"]:
                    self._kill(c, self._grace(), "failed startup probe, will be restarted")
            elif p.kind == "liveness":
                if p.failures >= p.spec["failureThreshold"]:
                    self._kill(c, self._grace(), "failed liveness probe, will be restarted")
            elif p.kind == "readiness":
                if p.successes >= p.spec["successThreshold"]:
                    c.ready = True
                elif p.failures >= p.spec["failureThreshold"]:
                    c.ready = False
        if not has_readiness:
            c.ready = c.started and c.proc is not None

    def _grace(self) -> float:
        return float(self.pod["spec"].get("terminationGracePeriodSeconds", 30))

    def _step(self) -> None:
        policy = self.pod["spec"].get("restartPolicy", "Always")
        now = time.monotonic()
        if not self.initialized:
            for c in self.init_ctrs:
                if c.exit_code == 0 and c.proc is None:
                    continue
                self._poll(c, "OnFailure" if policy != "Never" else "Never")
                if c.proc is None and now >= c.next_start:
                    self._start(c)
                break
            self.initialized = all(c.exit_code == 0 and c.proc is None for c in self.init_ctrs)
            if not self.initialized:
                return
        for c in self.ctrs:
            self._poll(c, policy)
            if c.proc is None and now >= c.next_start:
                self._start(c)
            self._probe(c)

    def _reap_all(self) -> None:
        for c in self.init_ctrs + self.ctrs:
            if c.proc is not None:
                killpg(c.proc.pid, signal.SIGKILL)
                c.proc.wait()
                c.proc = None
        kill_marked(POD_MARKER, self.uid)

    def _terminate(self, grace: float) -> None:
        running = [c for c in self.init_ctrs + self.ctrs if c.proc is not None]
        for c in running:
            c.kill_deadline = None
            self._kill(c, grace, "pod deleted", restart=False)
        while any(c.proc is not None for c in running):
            if self.off or self.node.stopping.is_set():
                self._reap_all()
                return
            for c in running:
                self._poll(c, "Never")
            time.sleep(0.05)
        kill_marked(POD_MARKER, self.uid)
        if not self.gone:
            self._post_status()

    def _finalize_delete(self) -> None:
        try:
            self.node.core.delete_namespaced_pod(
                self.meta["name"],
                self.meta["namespace"],
                body={"gracePeriodSeconds": 0, "preconditions": {"uid": self.uid}},
            )
        except ApiException as e:
            if e.status not in (404, 409):
                log.warning("%s: final delete failed: %s", self.name, e)

    # -- status -------------------------------------------------------------------------------
    def _ctr_status(self, c: Ctr) -> dict:
        st = {
            "name": c.name,
            "image": c.spec.get("image", ""),
            "imageID": "",
            "ready": c.ready,
            "started": c.started and c.proc is not None,
            "restartCount": c.restart_count,
            "state": c.state,
            "lastState": c.last_state,
        }
        if c.container_id:
            st["containerID"] = c.container_id
        return st

    def _cond(self, type_: str, ok: bool) -> dict:
        status = "True" if ok else "False"
        prev = self.cond_times.get(type_)
        if prev is None or prev[0] != status:
            self.cond_times[type_] = (status, now_iso())
        return {"type": type_, "status": status, "lastTransitionTime": self.cond_times[type_][1]}

    def _status(self) -> dict:
        policy = self.pod["spec"].get("restartPolicy", "Always")
        if not self.initialized:
            init_failed = policy == "Never" and any(
                "terminated" in c.state and c.exit_code not in (0, None) for c in self.init_ctrs
            )
            phase = "Failed" if init_failed else "Pending"
        else:
            phase = podlogic.pod_phase(
                policy,
                [
                    {
                        "started": c.ever_started,
                        "running": c.proc is not None,
                        "exit_code": c.exit_code,
                    }
                    for c in self.ctrs
                ],
            )
        containers_ready = self.initialized and all(
            c.ready and c.proc is not None for c in self.ctrs
        )
        existing = {c["type"]: c for c in (self.pod.get("status") or {}).get("conditions") or []}
        gates = [g["conditionType"] for g in self.pod["spec"].get("readinessGates") or []]
        gates_ok = all(existing.get(g, {}).get("status") == "True" for g in gates)
        conds = [
            self._cond("PodReadyToStartContainers", True),
            self._cond("Initialized", self.initialized),
            self._cond("ContainersReady", containers_ready),
            self._cond("Ready", containers_ready and gates_ok),
        ]
        # keep conditions owned by others (PodScheduled, readiness gates, DisruptionTarget)
        mine = {c["type"] for c in conds}
        conds += [c for t, c in existing.items() if t not in mine]
        status = {
            "phase": phase,
            "conditions": conds,
            "hostIP": HOST_IP,
            "hostIPs": [{"ip": HOST_IP}],
            "podIP": self.pod_ip,
            "podIPs": [{"ip": self.pod_ip}],
            "startTime": self.start_time,
            "containerStatuses": [self._ctr_status(c) for c in self.ctrs],
        }
        if self.init_ctrs:
            status["initContainerStatuses"] = [self._ctr_status(c) for c in self.init_ctrs]
        return status

    def _post_status(self) -> None:
        status = self._status()
        if status == self.last_status:
            # re-assert what someone else overwrote (the node controller's Ready=False)
            drift = podlogic.status_drift(self.pod.get("status") or {}, status)
            if not drift or time.monotonic() - self.last_post < REASSERT_MIN_S:
                return
            log.info("%s: API status differs (%s): re-asserting", self.name, ", ".join(drift))
        try:
            self.node.core.patch_namespaced_pod_status(
                self.meta["name"],
                self.meta["namespace"],
                {"status": status},
                _content_type="application/merge-patch+json",
            )
            self.last_status = status
            self.last_post = time.monotonic()
        except ApiException as e:
            if e.status == 404:
                self.gone = True
            else:
                log.warning("%s: status update failed: %s", self.name, e)
