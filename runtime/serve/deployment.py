"""``eaas serve``'s deployment: the placement, routing table version 1, the expert servers and
attention clients it starts (their command lines from the options objects), the local monitor
that republishes the table when a server exits, starts the server again with back-off
(:mod:`eaas.runtime.serve.restarts`) and puts it back into the table once it serves, and the
ordered stop. The package docstring (:mod:`eaas.runtime.serve`) tells the whole story.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import time
from pathlib import Path

from eaas.runtime.client.budgets import parse_prefill_cap
from eaas.runtime.client.kv_cache import check_kv_cache_memory, parse_memory_size
from eaas.runtime.client.main import bind_listener
from eaas.runtime.common.dtypes import torch_dtype
from eaas.runtime.common.logs import LOG_FORMAT_ENV
from eaas.runtime.common.ports import free_tcp_port
from eaas.runtime.cuda.device import resolve_device
from eaas.runtime.models.arch import read_model_info
from eaas.runtime.models.compute import check_policy
from eaas.runtime.models.tiny import default_model_dir
from eaas.runtime.options import AttentionClientOptions, ExpertServerOptions, ServeOptions
from eaas.runtime.options.api_key import api_key_environment
from eaas.runtime.placement import SCHED_POLICIES, place_experts, spread_over_cpus
from eaas.runtime.serve.children import Child, Children, log, module_command
from eaas.runtime.serve.restarts import RestartBackoff
from eaas.runtime.serve.rundir import create_run_dir, remove_stale_run_dirs
from eaas.runtime.serve.vllm_engine import check_vllm, mark_ready, vllm_child
from eaas.runtime.tables.expert_spec import format_expert_spec
from eaas.runtime.tables.table import RoutingTable


def _mark_vllm_ready(ch: Child) -> None:
    """A vllm child is ready once its ``/health`` answers (:func:`mark_ready`; a no-op for the
    other children, whose ready line sets ``ready``); ``ready_at`` as for a ready line."""
    if not ch.ready:
        mark_ready(ch)
        if ch.ready:
            ch.ready_at = time.monotonic()


class ServeError(RuntimeError):
    """A child failed to start (message names it and its exit code)."""


class ServeInterrupted(ServeError):
    """SIGINT/SIGTERM arrived during start-up; ``signum`` is the signal's number."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"interrupted by {signal.Signals(signum).name} during start-up")


def _check_port_free(host: str, port: int) -> None:
    """Fail fast when ``host:port`` is taken (also by another ``eaas serve``: its clients bind with
    ``SO_REUSEPORT``, so without this check a second deployment would silently share the port).

    Raises:
        ValueError: ``host:port`` cannot be bound; the message names ``--port`` when the port is
            taken or not allowed, else ``--host`` (an address that is no local one or no address
            at all), and the OS's reason.
    """
    try:
        bind_listener(host, port).close()
    except OSError as exc:
        flag = (
            f"--port {port}" if exc.errno in (errno.EADDRINUSE, errno.EACCES) else f"--host {host}"
        )
        raise ValueError(f"{flag}: cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def write_table(path: Path, table: RoutingTable) -> None:
    """Atomically replace ``path`` with ``table`` (write a temp file, then rename)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(table.to_json(), encoding="utf-8")
    os.replace(tmp, path)


class Deployment:
    """All processes of one local deployment (see :mod:`eaas.runtime.serve`).

    Args:
        options: the validated :class:`~eaas.runtime.options.ServeOptions`; here the checks
            that need torch or this machine run, before any process starts: the CPU bf16
            policy, the KV-cache size (also against one longest sequence), the client's and the
            server's device, the prefill cap, the API port being free, the model and the
            placement (``expert_servers >= replicas``).
        ready_timeout: seconds :meth:`start` waits for every child's ready line.

    With ``server_cpus == "auto"`` each expert server is pinned to one CPU of this process's
    CPU set (its ``--cpus``), the servers one decode call reaches on different CPUs
    (:func:`~eaas.runtime.placement.spread_over_cpus`), when there are at least 2 servers and 2
    CPUs and ``server_threads`` is 1 and the engine is ``eaas`` (with ``vllm``, vLLM binds its
    worker's OpenMP threads to CPUs of its own choice, and a server pinned to the worker's CPU
    takes it from vLLM); :attr:`server_cpu_list` holds the result (None: not pinned).
    ``server_sched_policy`` ``"batch"`` (SCHED_BATCH): a server woken by a client's doorbell
    does not preempt that client, which still rings the other servers of the call and computes
    the shared expert.

    Raises:
        ValueError, PlacementError, FileNotFoundError: an option this machine or the model
            cannot serve (the message names the flag).
    """

    def __init__(self, options: ServeOptions, *, ready_timeout: float = 300.0) -> None:
        o = self.options = options
        if o.server_sched_policy not in SCHED_POLICIES:
            raise ValueError(
                f"--server-sched-policy must be batch or other, got {o.server_sched_policy!r}"
            )
        check_policy(o.cpu_bf16_compute)  # ValueError before any process starts
        kv_bytes = None
        if o.kv_cache_memory is not None:
            kv_bytes = parse_memory_size(o.kv_cache_memory)
        try:  # the attention client's own check (a CUDA device that is not there), up front
            resolve_device(o.client_device)
        except ValueError as exc:
            raise ValueError(str(exc).replace("--device", "--client-device", 1)) from None
        try:  # the expert server's own check, up front
            resolve_device(o.server_device)
        except ValueError as exc:
            raise ValueError(str(exc).replace("--device", "--server-device", 1)) from None
        parse_prefill_cap(o.prefill_tokens_while_decoding)
        _check_port_free(o.host, o.port)
        #: ``python -m eaas`` of the expert servers: with ``--engine vllm`` the vllm command's
        #: Python when its eaas is this one (it has vLLM's CPU MoE kernel), else serve's own
        self.server_python = module_command("eaas")
        if o.engine == "vllm":
            self.server_python = check_vllm(o) or self.server_python  # before any server starts
        self.model_dir = str(o.model) if o.model is not None else str(default_model_dir())
        self.info = read_model_info(self.model_dir)
        if kv_bytes is not None:  # the engine's size check, before the clients load weights
            check_kv_cache_memory(self.model_dir, torch_dtype(o.dtype), kv_bytes)
        self.placement = place_experts(
            self.info.moe_layers, self.info.num_experts, o.expert_servers, o.replicas
        )
        cpus = sorted(os.sched_getaffinity(0))
        # the CPU of every expert server (--cpus), or None: not pinned
        self.server_cpu_list: tuple[int, ...] | None = None
        self.not_pinned_why = ""  # why auto did not pin, for the log line
        if o.server_cpus == "auto":
            if o.server_threads != 1:
                self.not_pinned_why = ": --server-threads is not 1"
            elif o.engine == "vllm":  # vLLM binds its worker's OpenMP threads to CPUs itself
                self.not_pinned_why = ": --engine vllm (vLLM binds its worker to CPUs)"
            elif o.expert_servers < 2 or len(cpus) < 2:
                self.not_pinned_why = f": {o.expert_servers} server(s), {len(cpus)} CPU(s)"
            else:
                self.server_cpu_list = spread_over_cpus(self.placement, cpus)
        self.n, self.r, self.m = o.expert_servers, o.replicas, o.attention_clients
        self.server_ids = [f"expert-{i}" for i in range(self.n)]
        self.full_table: RoutingTable | None = None  # version 1: every server
        self.down: set[str] = set()  # expert servers not serving now (out of the table)
        #: restart schedules by child name (an expert server's name is its id)
        self.backoff = {sid: RestartBackoff() for sid in self.server_ids}
        self.ready_timeout = ready_timeout
        self.children = Children()
        self.run_dir: Path | None = None
        self.table: RoutingTable | None = None
        self.table_path: Path | None = None
        self._stop = False
        self._stop_signal: int | None = None  # the first SIGINT/SIGTERM's number
        self._stopping = False

    def _live_dir(self) -> Path:
        """The run directory of a started deployment. Raises RuntimeError before ``start``."""
        if self.run_dir is None:
            raise RuntimeError("the deployment is not started")
        return self.run_dir

    @property
    def routing_table(self) -> RoutingTable:
        """The routing table last published. Raises RuntimeError before ``start``."""
        if self.table is None:
            raise RuntimeError("the deployment is not started")
        return self.table

    # ---- start ----------------------------------------------------------------------------
    def _env(self) -> dict:
        """The children's base environment: serve's own, without its API keys (only the
        attention clients get them, through their options: an expert server needs none)."""
        env = api_key_environment(os.environ, ())  # without $EAAS_API_KEY
        env["PROMETHEUS_MULTIPROC_DIR"] = str(self._live_dir() / "metrics")
        env["PYTHONUNBUFFERED"] = "1"
        env[LOG_FORMAT_ENV] = "plain"  # serve's relay adds the time stamp and the child's name
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env.setdefault("HF_HUB_OFFLINE", "1")
        return env

    def start(self) -> None:
        """Write the routing table, start all children, wait until all are ready.

        Run directories that SIGKILLed serve processes left behind are removed first
        (:func:`remove_stale_run_dirs`); this one records its owner (pid, start time).

        Raises:
            ServeInterrupted: SIGINT/SIGTERM arrived during start-up.
            ServeError: a child exited during start-up or not all were ready in time (all
                children are stopped and the run directory removed before raising).
        """
        o = self.options
        if self._stop_signal is not None:
            raise ServeInterrupted(self._stop_signal)
        removed = remove_stale_run_dirs()
        if removed:
            log(
                f"removed {len(removed)} run director{'ies' if len(removed) != 1 else 'y'} of "
                f"serve processes that are gone: {', '.join(map(str, removed))}"
            )
        run_dir = self.run_dir = create_run_dir()
        ids = self.server_ids
        if o.transport == "shm":
            endpoints = [f"unix:{run_dir / f'{sid}.sock'}" for sid in ids]
        else:
            endpoints = [f"tcp://127.0.0.1:{free_tcp_port()}" for _ in ids]
        self.table = self.full_table = RoutingTable.from_placement(
            self.placement, ids, endpoints, version=1
        )
        table_path = self.table_path = run_dir / "routing-table.json"
        write_table(table_path, self.table)
        env = self._env()
        py = self.server_python  # never a folder named eaas in the working directory
        try:
            for s, (sid, ep) in enumerate(zip(ids, endpoints, strict=False)):
                server = ExpertServerOptions(
                    model=self.model_dir,
                    server_id=sid,
                    experts=format_expert_spec(self.placement.servers[s]),
                    listen=ep,
                    dtype=o.dtype,
                    cpu_bf16_compute=o.cpu_bf16_compute,
                    threads=o.server_threads,
                    device=o.server_device,
                    cpu_kernel=o.server_cpu_kernel,
                    cpus=None if self.server_cpu_list is None else str(self.server_cpu_list[s]),
                    sched_policy=o.server_sched_policy,
                )
                self.children.spawn(
                    Child(sid, "expert-server", py + server.argv(), server_id=sid), env
                )
            if o.engine == "vllm":  # one vllm serve in the clients' place (vllm_engine.py)
                child, extra = vllm_child(o, self.model_dir, table_path)
                self.children.spawn(child, {**env, **extra})
            for c in range(self.m if o.engine == "eaas" else 0):
                client = AttentionClientOptions(
                    model=self.model_dir,
                    client_id=str(c),
                    routing_table=str(table_path),
                    port=o.port,
                    host=o.host,
                    reuse_port=True,
                    dispatch_timeout=o.dispatch_timeout,
                    dtype=o.dtype,
                    cpu_bf16_compute=o.cpu_bf16_compute,
                    threads=o.client_threads,
                    device=o.client_device,
                    max_num_batched_tokens=o.max_num_batched_tokens,
                    kv_cache_memory=o.kv_cache_memory or None,
                    prefill_tokens_while_decoding=o.prefill_tokens_while_decoding,
                    double_batch_overlap=o.double_batch_overlap,
                    spin_us=o.spin_us,  # None unless --transport shm
                    served_model_name=o.served_model_name,
                    api_key=o.api_key,  # in the child's environment, not its argv
                )
                name = f"attention-client-{c}"
                child = Child(name, "attention-client", py + client.argv())
                self.children.spawn(child, client.environment(env))
            deadline = time.monotonic() + self.ready_timeout
            while not all(ch.ready for ch in self.children):
                if self._stop_signal is not None:
                    raise ServeInterrupted(self._stop_signal)
                if self._stop:  # request_stop() called without a signal
                    raise ServeError("stopped during start-up")
                if time.monotonic() > deadline:
                    late = [ch.name for ch in self.children if not ch.ready]
                    raise ServeError(
                        f"not ready after {self.ready_timeout:.0f} s: {', '.join(late)}"
                    )
                self.children.pump(0.2)
                for ch in self.children:
                    _mark_vllm_ready(ch)
                    rc = ch.popen.poll()
                    if rc is not None:
                        raise ServeError(f"{ch.name} exited with code {rc} during start-up")
        except BaseException:
            self.stop()
            raise

    # ---- liveness ---------------------------------------------------------------------
    def _publish(self) -> RoutingTable:
        """Write the next routing table version: every server but those :attr:`down`."""
        if self.full_table is None or self.table_path is None:
            raise RuntimeError("the deployment is not started")
        table = self.full_table.without_servers(self.down).with_version(
            self.routing_table.version + 1
        )
        self.table = table
        write_table(self.table_path, table)
        return table

    def _server_exited(self, ch: Child, rc: int) -> None:
        """An expert server exited: take it out of the table, schedule its restart, say what
        the clients do meanwhile."""
        sid = ch.server_id or ch.name
        pid = ch.popen.pid
        assert self.full_table is not None  # started: a table exists
        hosted = self.full_table.hosted_by(sid)
        if sid not in self.down:
            self.down.add(sid)
            table = self._publish()
            published = f"; routing table version {table.version} leaves it out"
        else:  # it exited again before serving: already out of the table
            table, published = self.routing_table, ""
        lost = [p for p in hosted if not table.replicas(*p)]
        if not hosted:
            meanwhile = ""
        elif lost:
            meanwhile = (
                f"; {len(lost)} of its experts have no other replica"
                f"{' (--replicas 1)' if self.r == 1 else ''}: requests that need them fail "
                "with 503 until it serves again"
            )
        else:
            meanwhile = "; clients send its tokens to the other replicas"
        if self.options.restart_expert_servers:
            delay = self.backoff[sid].exited(time.monotonic(), ch.ready_at)
            then = f"; restarting it in {delay:.0f} s"
        else:
            then = "; not restarted (--no-restart-expert-servers)"
        log(
            f"expert server {ch.name} (pid {pid}) exited with code {rc}{published}{meanwhile}"
            f"{then}",
            "WARNING",
        )

    def _check_children(self) -> None:
        for ch in self.children:
            rc = ch.popen.poll()
            if rc is None or ch.exit_logged:
                continue
            ch.exit_logged = True
            self.children.kill_group(ch)  # what it started (vLLM's EngineCore) goes with it
            self._mark_dead_metrics(ch.popen.pid)
            if ch.role == "expert-server" and self.table_path is not None:
                self._server_exited(ch, rc)
            else:
                self._client_exited(ch, rc)

    def _client_exited(self, ch: Child, rc: int) -> None:
        """An attention client (or ``vllm serve``) exited: its running requests are lost (it
        holds their KV cache); the other clients on the port keep serving. Schedule its
        restart, or say that it stays down."""
        if self.options.restart_attention_clients:
            backoff = self.backoff.setdefault(ch.name, RestartBackoff())
            delay = backoff.exited(time.monotonic(), ch.ready_at)
            then = f"; restarting it in {delay:.0f} s"
        else:
            then = "; not restarted (--no-restart-attention-clients)"
        log(
            f"attention client {ch.name} (pid {ch.popen.pid}) exited with code {rc}: its "
            f"running requests ended{then}",
            "WARNING",
        )

    def _restart_clients(self) -> None:
        """Start again the exited attention clients whose back-off has expired (same command
        line and environment); a vllm child is ready again once its ``/health`` answers."""
        now = time.monotonic()
        for ch in self.children:
            if ch.role == "expert-server":
                continue
            backoff = self.backoff.get(ch.name)
            if ch.exit_logged and backoff is not None and backoff.due(now):
                backoff.restarted()
                self.children.respawn(ch)
                log(
                    f"restarted attention client {ch.name} (pid {ch.popen.pid}, restart "
                    f"{ch.restarts})"
                )
            elif not ch.ready and ch.popen.poll() is None:
                _mark_vllm_ready(ch)

    def _restart_servers(self) -> None:
        """Start again the exited expert servers whose back-off has expired; put the ones that
        serve again (their ready line) back into the routing table."""
        now = time.monotonic()
        for ch in self.children:
            if ch.role != "expert-server":
                continue
            sid = ch.server_id or ch.name
            backoff = self.backoff[sid]
            if ch.exit_logged and backoff.due(now):
                backoff.restarted()
                self.children.respawn(ch, self._env())
                log(
                    f"restarted expert server {ch.name} (pid {ch.popen.pid}, restart {ch.restarts})"
                )
            elif sid in self.down and ch.ready and ch.popen.poll() is None:
                self.down.discard(sid)
                table = self._publish()
                log(
                    f"expert server {ch.name} (pid {ch.popen.pid}) serves again: routing table "
                    f"version {table.version} has it back"
                )

    def _mark_dead_metrics(self, pid: int) -> None:
        try:
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(pid, str(self._live_dir() / "metrics"))
        except Exception:  # noqa: BLE001
            pass

    def serve_forever(self) -> int:
        """Relay output and watch children until a stop signal (or, without
        ``restart_attention_clients``, until all clients are gone).

        Returns the process exit code (0 on a signal, 1 when every attention client died).
        """
        while not self._stop:
            self.children.pump(0.2)
            if self._stop:  # stopping: no restarts
                break
            self._check_children()
            self._restart_servers()
            self._restart_clients()
            if not self.options.restart_attention_clients and all(
                ch.popen.poll() is not None for ch in self.children if ch.role == "attention-client"
            ):
                log("no attention client left; shutting down")
                return 1
        return 0

    def request_stop(self, signum: int | None = None, _frame: object = None) -> None:
        """Signal handler: stop gracefully; a second Ctrl-C while stopping kills the children."""
        if self._stopping and signum == signal.SIGINT:
            log("second Ctrl-C: killing all processes now (SIGKILL)")
            self.children.kill_all()
        self._stop = True
        if signum is not None and self._stop_signal is None:
            self._stop_signal = signum

    # ---- stop -----------------------------------------------------------------------------
    def stop(self, grace: float = 15.0) -> None:
        """Terminate the clients (SIGTERM) and wait for them, then the servers; SIGKILL what is
        left after ``grace`` seconds (in all); remove the run dir."""
        self._stopping = True
        t0 = self.children.stop(grace)
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            self.run_dir = None
        if t0 is not None:
            log(f"all processes stopped in {time.monotonic() - t0:.1f} s")


def plural(n: int, noun: str) -> str:
    """``"1 replica"``, ``"2 replicas"``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def serve(options: ServeOptions) -> int:
    """Run a deployment until SIGINT/SIGTERM; returns the exit code: 0 after a signal once
    serving, 1 when start-up failed or every client died, 128 + the signal's number (130
    SIGINT, 143 SIGTERM) when a signal interrupted start-up.

    Raises:
        ValueError, PlacementError, FileNotFoundError: options this machine or the model cannot
            serve (before any process starts; :class:`Deployment`).
    """
    dep = Deployment(options)
    signal.signal(signal.SIGTERM, dep.request_stop)
    signal.signal(signal.SIGINT, dep.request_stop)
    log(
        f"placement: {len(dep.info.moe_layers)} MoE layers x {dep.info.num_experts} experts, "
        f"{plural(dep.r, 'replica')} of each on {plural(dep.n, 'server')} "
        f"({dep.placement.experts_per_server()} experts per server)"
    )
    if dep.server_cpu_list is not None:
        log(f"expert servers pinned to CPUs {list(dep.server_cpu_list)} (--server-cpus auto)")
    else:
        log(
            f"expert servers not pinned (--server-cpus {dep.options.server_cpus}{dep.not_pinned_why})"
        )
    try:
        dep.start()
    except ServeInterrupted as exc:
        log(f"{exc}: stopped (nothing is serving)")
        return 128 + exc.signum
    except ServeError as exc:
        log(f"start-up failed: {exc}")
        return 1
    try:
        name = Path(dep.model_dir).name
        log(f"routing table version {dep.routing_table.version}: {dep.table_path}")
        log(
            f"serving {name} on http://{dep.options.host}:{dep.options.port} "
            f"({plural(dep.n, 'expert server')}, {plural(dep.r, 'replica')}, "
            f"{plural(dep.m, 'client')})"
        )
        return dep.serve_forever()
    finally:
        dep.stop()
