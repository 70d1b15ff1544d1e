"""``eaas serve``: a whole EaaS deployment on one machine, one OS process per role.

What it does:

1. Reads the model's :class:`~eaas.runtime.models.arch.ModelInfo`, computes the placement
   ``place_experts(info.moe_layers, info.num_experts, N, R)`` and writes routing table version 1
   (``routing-table.json``) into a fresh run directory.
2. Starts ``N`` expert servers and ``M`` attention clients, each as its own process running the
   SAME entry point a Kubernetes pod runs (``python -m eaas expert-server ...`` /
   ``python -m eaas attention-client ...``), so ``ps`` shows every process's role. Clients start
   in parallel with the servers (they connect lazily). All children share one fresh
   ``PROMETHEUS_MULTIPROC_DIR``, so ``GET /metrics`` on the API port carries every process's
   series. All ``M`` clients bind the same API port with ``SO_REUSEPORT``.
3. Waits for every child's ready line, then prints
   ``serving <model> on http://HOST:PORT (N expert servers, R replicas, M clients)``.
4. Acts as the local *monitor*: when an expert server exits, it logs it and publishes a new
   routing table version without that server (clients fail over on their own before that and
   hot-reload the new table). A dead attention client is logged; when none is left, serve exits.
5. SIGINT/SIGTERM: terminate the attention clients and wait until they exit (their running
   requests end while the expert servers still answer), then the expert servers; SIGKILL after
   a grace period (a second Ctrl-C: at once), remove the run directory (Unix sockets, routing
   table, metrics files). A signal during start-up stops what started and exits with 128 + the
   signal's number. The run directory holds an owner file (pid, start time): a later serve
   removes the directories whose owner is gone (a SIGKILLed serve cannot). Children get
   ``PR_SET_PDEATHSIG=SIGKILL`` (set between fork and exec), so they die with serve even if
   serve is SIGKILLed. Shared memory of the shm transport is memfd-based: nothing in
   ``/dev/shm``.

Child output: each child's stdout lines are relayed to serve's stdout prefixed with its name;
stderr is inherited.
"""

from __future__ import annotations

import ctypes
import os
import re
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from eaas.runtime.placement import (
    SCHED_POLICIES,
    format_expert_spec,
    place_experts,
    spread_over_cpus,
)
from eaas.runtime.routing import RoutingTable
from eaas.text import printable

PR_SET_PDEATHSIG = 1


class ServeError(RuntimeError):
    """A child failed to start (message names it and its exit code)."""


class ServeInterrupted(ServeError):
    """SIGINT/SIGTERM arrived during start-up; ``signum`` is the signal's number."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"interrupted by {signal.Signals(signum).name} during start-up")


RUN_DIR_PREFIX = "eaas-serve-"
OWNER_FILE = "owner"  # in a run dir: "<pid> <start time in clock ticks since boot>" of its serve


def _proc_start_ticks(pid: int) -> int | None:
    """The process's start time (``/proc/PID/stat`` field 22, clock ticks since boot), or None
    when it cannot be read (no such process, no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may itself hold spaces or ')'
    return int(stat[stat.rindex(b")") + 2 :].split()[19])


def _owner_alive(pid: int, start_ticks: int | None) -> bool:
    """Whether the process that wrote an owner file still runs: ``pid`` exists and, when both
    are known, has the recorded start time (a reused pid is another process)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    now = _proc_start_ticks(pid)
    return start_ticks is None or now is None or now == start_ticks


def stale_run_dirs(tmp: Path) -> list[Path]:
    """Run directories (``<tmp>/eaas-serve-*``) of ``eaas serve`` processes that are gone (a
    SIGKILLed serve cannot remove its own): those whose owner file names a dead process.

    A directory without a readable owner file is never listed (a serve between creating its
    directory and writing the file, or one of another tool); neither is another user's.
    """
    stale = []
    for d in sorted(tmp.glob(f"{RUN_DIR_PREFIX}*")):
        try:
            if not d.is_dir() or d.is_symlink() or d.stat().st_uid != os.getuid():
                continue
            fields = (d / OWNER_FILE).read_text().split()
            pid, ticks = int(fields[0]), (int(fields[1]) if len(fields) > 1 else None)
        except (OSError, ValueError, IndexError):
            continue
        if not _owner_alive(pid, ticks):
            stale.append(d)
    return stale


def remove_stale_run_dirs(tmp: Path | None = None) -> list[Path]:
    """Remove :func:`stale_run_dirs` of ``tmp`` (default: ``tempfile.gettempdir()``); returns
    the removed directories."""
    removed = []
    for d in stale_run_dirs(Path(tmp or tempfile.gettempdir())):
        shutil.rmtree(d, ignore_errors=True)
        if not d.exists():
            removed.append(d)
    return removed


def _check_port_free(host: str, port: int) -> None:
    """Fail fast when ``host:port`` is taken (also by another ``eaas serve``: its clients bind with
    ``SO_REUSEPORT``, so without this check a second deployment would silently share the port).

    Raises:
        ValueError: the port cannot be bound (message names it and the OS reason).
    """
    from eaas.runtime.client.main import bind_listener

    try:
        bind_listener(host, port).close()
    except OSError as exc:
        raise ValueError(
            f"--port {port}: cannot listen on {host}:{port}: {exc.strerror or exc}"
        ) from None


def _log(msg: str) -> None:
    print(f"[eaas serve] {msg}", flush=True)


def _pdeathsig_preexec(parent: int):
    libc = ctypes.CDLL(None, use_errno=True)

    def fn() -> None:  # runs in the child between fork and exec: no Python threads exist in serve
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # parent died before prctl took effect
            os._exit(1)

    return fn


def parse_client_spin(value: str | float | None) -> float | None:
    """``--client-spin-us``: None / ``"default"`` (the transport's own busy-poll) or a number of
    microseconds >= 0 (0: block at once). Raises ValueError naming the option."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "default"):
        return None
    try:
        us = float(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"--client-spin-us must be default or microseconds >= 0, got {value!r}"
        ) from None
    if not us >= 0 or us == float("inf"):
        raise ValueError(f"--client-spin-us must be default or microseconds >= 0, got {value!r}")
    return us


def free_tcp_port(host: str = "127.0.0.1") -> int:
    """A currently free TCP port on ``host`` (racy by nature; fine for local runs/tests)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class Child:
    name: str
    role: str  # "expert-server" | "attention-client"
    argv: list[str]
    proc: subprocess.Popen | None = None
    ready: bool = False
    buf: bytes = b""
    server_id: str | None = None
    exit_logged: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def popen(self) -> subprocess.Popen:
        """The started process. Raises RuntimeError before :meth:`Deployment._spawn`."""
        if self.proc is None:
            raise RuntimeError(f"{self.name} was not started")
        return self.proc


def write_table(path: Path, table: RoutingTable) -> None:
    """Atomically replace ``path`` with ``table`` (write a temp file, then rename)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(table.to_json(), encoding="utf-8")
    os.replace(tmp, path)


class Deployment:
    """All processes of one local deployment (see the module docstring).

    Args:
        model_dir: checkpoint (None: the built-in tiny model, built on first use).
        expert_servers: ``N`` (>= replicas).
        replicas: ``R``, replicas per logical expert on distinct servers.
        attention_clients: ``M``.
        host, port: API address shared by all clients.
        transport: ``"shm"`` (Unix socket + memfd shared memory) or ``"tcp"``.
        dispatch_timeout: clients' per-round deadline in seconds.
        dtype: activation/weight dtype of every process.
        cpu_bf16_compute: every process's ``--cpu-bf16-compute`` (``auto``, ``native``,
            ``fp32``; :mod:`eaas.runtime.models.compute`): each process decides for itself.
        client_threads / server_threads: torch intra-op threads per process.
        client_device: attention clients' ``--device`` (auto, cpu, cuda, cuda:N).
        server_device: expert servers' ``--device`` (default cpu: the CPU path, unchanged).
        kv_cache_memory: attention clients' ``--kv-cache-memory`` (e.g. ``"1GiB"``; None: default).
        max_num_batched_tokens: attention clients' ``--max-num-batched-tokens``.
        double_batch_overlap: attention clients' ``--double-batch-overlap``.
        prefill_tokens_while_decoding: attention clients' ``--prefill-tokens-while-decoding``
            (``"auto"``, ``"off"`` or a token count).
        client_spin_us: attention clients' ``--spin-us`` (shm only): None / ``"default"``
            (the transport's busy-poll) or microseconds >= 0 (0: block at once).
        server_cpus: ``"auto"``: pin each expert server to one CPU of this process's CPU set
            (its ``--cpus``), the servers one decode call reaches on different CPUs
            (:func:`~eaas.runtime.placement.spread_over_cpus`), when there are at least 2
            servers and 2 CPUs and ``server_threads`` is 1; ``"none"``: not pinned.
            :attr:`server_cpu_list` holds the result (None: not pinned).
        server_sched_policy: expert servers' ``--sched-policy``: ``"batch"`` (SCHED_BATCH: a
            server woken by a client's doorbell does not preempt that client, which still rings
            the other servers of the call and computes the shared expert) or ``"other"``.
    """

    def __init__(
        self,
        *,
        model_dir: str | None = None,
        expert_servers: int = 4,
        replicas: int = 2,
        attention_clients: int = 1,
        host: str = "127.0.0.1",
        port: int = 8000,
        transport: str = "shm",
        dispatch_timeout: float = 5.0,
        dtype: str = "float32",
        cpu_bf16_compute: str = "auto",
        client_threads: int = 1,
        server_threads: int = 1,
        client_device: str = "auto",
        server_device: str = "cpu",
        kv_cache_memory: str | None = None,
        max_num_batched_tokens: int = 512,
        double_batch_overlap: bool = False,
        prefill_tokens_while_decoding: str = "auto",
        client_spin_us: str | float | None = None,
        server_cpus: str = "auto",
        server_sched_policy: str = "batch",
        ready_timeout: float = 300.0,
    ) -> None:
        if transport not in ("shm", "tcp"):
            raise ValueError(f"--transport must be shm or tcp, got {transport!r}")
        if attention_clients < 1:
            raise ValueError("--attention-clients must be >= 1")
        if server_cpus not in ("auto", "none"):
            raise ValueError(f"--server-cpus must be auto or none, got {server_cpus!r}")
        if server_sched_policy not in SCHED_POLICIES:
            raise ValueError(
                f"--server-sched-policy must be batch or other, got {server_sched_policy!r}"
            )
        self.server_sched_policy = server_sched_policy
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"--dtype must be float32 or bfloat16, got {dtype!r}")
        from eaas.runtime.models.compute import check_policy

        check_policy(cpu_bf16_compute)  # ValueError before any process starts
        if not 1 <= port <= 65535:
            raise ValueError(f"--port must be in 1..65535, got {port}")
        kv_bytes = None
        if kv_cache_memory is not None:
            from eaas.runtime.client.kv_cache import parse_memory_size

            kv_bytes = parse_memory_size(kv_cache_memory)  # ValueError before any process starts
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", client_device):
            raise ValueError(
                f"--client-device must be auto, cpu, cuda or cuda:N, got {client_device!r}"
            )
        from eaas.runtime.client.main import resolve_device

        try:  # the attention client's own check (a CUDA device that is not there), up front
            resolve_device(client_device)
        except ValueError as exc:
            raise ValueError(str(exc).replace("--device", "--client-device", 1)) from None
        try:  # the expert server's own check, up front
            resolve_device(server_device)
        except ValueError as exc:
            raise ValueError(str(exc).replace("--device", "--server-device", 1)) from None
        if max_num_batched_tokens < 1:
            raise ValueError(f"--max-num-batched-tokens must be >= 1, got {max_num_batched_tokens}")
        from eaas.runtime.client.engine import parse_prefill_cap

        parse_prefill_cap(prefill_tokens_while_decoding)  # ValueError before any process starts
        _check_port_free(host, port)
        if model_dir is None:
            from eaas.runtime.models.tiny import default_model_dir

            model_dir = str(default_model_dir())
        from eaas.runtime.models.arch import read_model_info

        self.model_dir = str(model_dir)
        self.info = read_model_info(self.model_dir)
        if kv_bytes is not None:  # the engine's size check, before the clients load weights
            import torch

            from eaas.runtime.client.kv_cache import check_kv_cache_memory

            dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
            check_kv_cache_memory(self.model_dir, dtypes[dtype], kv_bytes)
        self.placement = place_experts(
            self.info.moe_layers, self.info.num_experts, expert_servers, replicas
        )
        cpus = sorted(os.sched_getaffinity(0))
        # the CPU of every expert server (--cpus), or None: not pinned
        self.server_cpu_list: tuple[int, ...] | None = None
        self.server_cpus = server_cpus
        self.not_pinned_why = ""  # why auto did not pin, for the log line
        if server_cpus == "auto":
            if server_threads != 1:
                self.not_pinned_why = ": --server-threads is not 1"
            elif expert_servers < 2 or len(cpus) < 2:
                self.not_pinned_why = f": {expert_servers} server(s), {len(cpus)} CPU(s)"
            else:
                self.server_cpu_list = spread_over_cpus(self.placement, cpus)
        self.n, self.r, self.m = expert_servers, replicas, attention_clients
        self.host, self.port = host, port
        self.transport = transport
        self.dispatch_timeout = dispatch_timeout
        self.dtype = dtype
        self.cpu_bf16_compute = cpu_bf16_compute
        self.client_threads, self.server_threads = client_threads, server_threads
        self.client_device = client_device
        self.server_device = server_device
        self.kv_cache_memory = kv_cache_memory
        self.max_num_batched_tokens = max_num_batched_tokens
        self.double_batch_overlap = bool(double_batch_overlap)
        self.prefill_tokens_while_decoding = str(prefill_tokens_while_decoding)
        # ValueError before any process starts
        self.client_spin_us = parse_client_spin(client_spin_us)
        if transport != "shm" and self.client_spin_us is not None:
            raise ValueError("--client-spin-us acts on --transport shm only")
        self.ready_timeout = ready_timeout
        self.children: list[Child] = []
        self.run_dir: Path | None = None
        self.table: RoutingTable | None = None
        self.table_path: Path | None = None
        self._sel = selectors.DefaultSelector()
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
        env = dict(os.environ)
        env["PROMETHEUS_MULTIPROC_DIR"] = str(self._live_dir() / "metrics")
        env["PYTHONUNBUFFERED"] = "1"
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env.setdefault("HF_HUB_OFFLINE", "1")
        return env

    def _spawn(self, child: Child, env: dict) -> None:
        proc = subprocess.Popen(
            child.argv,
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            env=env,
            preexec_fn=_pdeathsig_preexec(os.getpid()),
            close_fds=True,
        )
        child.proc = proc
        self.children.append(child)
        if proc.stdout is not None:  # always, with stdout=PIPE
            os.set_blocking(proc.stdout.fileno(), False)
            self._sel.register(proc.stdout, selectors.EVENT_READ, child)

    def start(self) -> None:
        """Write the routing table, start all children, wait until all are ready.

        Run directories that SIGKILLed serve processes left behind are removed first
        (:func:`remove_stale_run_dirs`); this one records its owner (pid, start time).

        Raises:
            ServeInterrupted: SIGINT/SIGTERM arrived during start-up.
            ServeError: a child exited during start-up or not all were ready in time (all
                children are stopped and the run directory removed before raising).
        """
        if self._stop_signal is not None:
            raise ServeInterrupted(self._stop_signal)
        removed = remove_stale_run_dirs()
        if removed:
            _log(
                f"removed {len(removed)} run director{'ies' if len(removed) != 1 else 'y'} of "
                f"serve processes that are gone: {', '.join(map(str, removed))}"
            )
        run_dir = self.run_dir = Path(tempfile.mkdtemp(prefix=RUN_DIR_PREFIX))
        pid = os.getpid()
        (run_dir / OWNER_FILE).write_text(f"{pid} {_proc_start_ticks(pid) or ''}".strip() + "\n")
        (run_dir / "metrics").mkdir()
        ids = [f"expert-{i}" for i in range(self.n)]
        if self.transport == "shm":
            endpoints = [f"unix:{run_dir / f'{sid}.sock'}" for sid in ids]
        else:
            endpoints = [f"tcp://127.0.0.1:{free_tcp_port()}" for _ in ids]
        self.table = RoutingTable.from_placement(self.placement, ids, endpoints, version=1)
        table_path = self.table_path = run_dir / "routing-table.json"
        write_table(table_path, self.table)
        env = self._env()
        py = [sys.executable, "-m", "eaas"]
        try:
            for s, (sid, ep) in enumerate(zip(ids, endpoints, strict=False)):
                argv = py + [
                    "expert-server",
                    "--model",
                    self.model_dir,
                    "--server-id",
                    sid,
                    "--experts",
                    format_expert_spec(self.placement.servers[s]),
                    "--listen",
                    ep,
                    "--dtype",
                    self.dtype,
                    "--cpu-bf16-compute",
                    self.cpu_bf16_compute,
                    "--threads",
                    str(self.server_threads),
                    "--device",
                    self.server_device,
                ]
                if self.server_cpu_list is not None:
                    argv += ["--cpus", str(self.server_cpu_list[s])]
                argv += ["--sched-policy", self.server_sched_policy]
                self._spawn(Child(sid, "expert-server", argv, server_id=sid), env)
            for c in range(self.m):
                argv = py + [
                    "attention-client",
                    "--model",
                    self.model_dir,
                    "--routing-table",
                    str(table_path),
                    "--client-id",
                    str(c),
                    "--host",
                    self.host,
                    "--port",
                    str(self.port),
                    "--dispatch-timeout",
                    str(self.dispatch_timeout),
                    "--dtype",
                    self.dtype,
                    "--cpu-bf16-compute",
                    self.cpu_bf16_compute,
                    "--reuse-port",
                    "--threads",
                    str(self.client_threads),
                ]
                argv += ["--device", self.client_device]
                argv += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
                argv += ["--prefill-tokens-while-decoding", self.prefill_tokens_while_decoding]
                if self.kv_cache_memory:
                    argv += ["--kv-cache-memory", self.kv_cache_memory]
                if self.double_batch_overlap:
                    argv += ["--double-batch-overlap"]
                if self.client_spin_us is not None and self.transport == "shm":
                    argv += ["--spin-us", f"{self.client_spin_us:g}"]
                self._spawn(Child(f"attention-client-{c}", "attention-client", argv), env)
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
                self._pump(0.2)
                for ch in self.children:
                    rc = ch.popen.poll()
                    if rc is not None:
                        raise ServeError(f"{ch.name} exited with code {rc} during start-up")
        except BaseException:
            self.stop()
            raise

    # ---- child output / liveness ----------------------------------------------------------
    def _pump(self, timeout: float) -> None:
        """Relay ready output lines of children (and detect ready lines) for up to ``timeout``."""
        for key, _ in self._sel.select(timeout):
            child: Child = key.data
            try:
                data = os.read(key.fd, 65536)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                self._sel.unregister(key.fileobj)
                if child.buf:
                    self._line(child, child.buf)
                    child.buf = b""
                continue
            child.buf += data
            while b"\n" in child.buf:
                line, child.buf = child.buf.split(b"\n", 1)
                self._line(child, line)

    def _line(self, child: Child, raw: bytes) -> None:
        line = raw.decode("utf-8", "replace").rstrip()
        if not child.ready and " ready on " in line and line.startswith(child.role):
            child.ready = True
        print(f"[{child.name}] {printable(line)}", flush=True)  # no raw control chars

    def _check_children(self) -> None:
        for ch in self.children:
            rc = ch.popen.poll()
            if rc is None or ch.exit_logged:
                continue
            ch.exit_logged = True
            pid = ch.popen.pid
            self._mark_dead_metrics(pid)
            if ch.role == "expert-server" and self.table_path is not None:
                _log(
                    f"expert server {ch.name} (pid {pid}) exited with code {rc}; clients fail over to other replicas"
                )
                table = self.table = self.routing_table.without_servers([ch.server_id or ch.name])
                write_table(self.table_path, table)
                unc = table.uncovered()
                _log(
                    f"published routing table version {table.version} without {ch.name}"
                    + (
                        f" ({len(unc)} experts have no replica left: requests needing them fail with 503)"
                        if unc
                        else ""
                    )
                )
            else:
                _log(f"attention client {ch.name} (pid {pid}) exited with code {rc}")

    def _mark_dead_metrics(self, pid: int) -> None:
        try:
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(pid, str(self._live_dir() / "metrics"))
        except Exception:  # noqa: BLE001
            pass

    def serve_forever(self) -> int:
        """Relay output and watch children until a stop signal or all clients are gone.

        Returns the process exit code (0 on a signal, 1 when every attention client died).
        """
        while not self._stop:
            self._pump(0.2)
            self._check_children()
            if all(
                ch.popen.poll() is not None for ch in self.children if ch.role == "attention-client"
            ):
                _log("no attention client left; shutting down")
                return 1
        return 0

    def request_stop(self, signum: int | None = None, _frame: object = None) -> None:
        """Signal handler: stop gracefully; a second Ctrl-C while stopping kills the children."""
        if self._stopping and signum == signal.SIGINT:
            _log("second Ctrl-C: killing all processes now (SIGKILL)")
            self._kill_all()
        self._stop = True
        if signum is not None and self._stop_signal is None:
            self._stop_signal = signum

    def _kill_all(self) -> None:
        for ch in self.children:
            if ch.proc is not None and ch.proc.poll() is None:
                try:
                    ch.proc.kill()
                except ProcessLookupError:
                    pass

    def _pump_quietly(self, timeout: float) -> None:
        try:
            self._pump(timeout)
        except Exception:  # noqa: BLE001  (a closed pipe while stopping: nothing left to relay)
            time.sleep(timeout)

    # ---- stop -----------------------------------------------------------------------------
    def stop(self, grace: float = 15.0) -> None:
        """Terminate the clients (SIGTERM) and wait for them, then the servers; SIGKILL what is
        left after ``grace`` seconds (in all); remove the run dir."""
        self._stopping = True
        alive = [ch for ch in self.children if ch.proc is not None and ch.proc.poll() is None]
        if alive:
            clients = sum(ch.role == "attention-client" for ch in alive)
            servers = len(alive) - clients
            _log(
                f"stopping {clients} attention client{'s' if clients != 1 else ''} and "
                f"{servers} expert server{'s' if servers != 1 else ''} "
                f"(SIGTERM, SIGKILL after {grace:.0f} s; Ctrl-C again to kill them now)"
            )
        t0 = time.monotonic()
        deadline = time.monotonic() + grace
        # Clients first, and wait for them: a client ends its running requests (or lets them
        # finish) while the expert servers still answer, so no request fails as if a server died.
        # Only then the servers (a server stopped first turns every running request into a 503
        # no_live_replica).
        for role in ("attention-client", "expert-server"):
            group = [ch for ch in self.children if ch.role == role and ch.proc is not None]
            for ch in group:
                if ch.proc is not None and ch.proc.poll() is None:
                    try:
                        ch.proc.terminate()
                    except ProcessLookupError:
                        pass
            for ch in group:
                proc = ch.popen
                while proc.poll() is None and time.monotonic() < deadline:
                    self._pump_quietly(0.1)  # relay their last lines while they stop
                if proc.poll() is None:
                    _log(f"{ch.name} did not exit within {grace:.0f} s; killing it")
                    proc.kill()
                proc.wait()
        try:
            self._pump(0)
        except Exception:  # noqa: BLE001
            pass
        for ch in self.children:
            if ch.proc is not None and ch.proc.stdout is not None:
                try:
                    self._sel.unregister(ch.proc.stdout)
                except (KeyError, ValueError):
                    pass
                ch.proc.stdout.close()
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            self.run_dir = None
        if alive:
            _log(f"all processes stopped in {time.monotonic() - t0:.1f} s")


def serve(**options) -> int:
    """Run a deployment until SIGINT/SIGTERM; returns the exit code: 0 after a signal once
    serving, 1 when start-up failed or every client died, 128 + the signal's number (130
    SIGINT, 143 SIGTERM) when a signal interrupted start-up.

    ``options`` are :class:`Deployment`'s keyword arguments.

    Raises:
        ValueError, PlacementError: invalid options (before any process starts).
    """
    dep = Deployment(**options)
    signal.signal(signal.SIGTERM, dep.request_stop)
    signal.signal(signal.SIGINT, dep.request_stop)
    _log(
        f"placement: {len(dep.info.moe_layers)} MoE layers x {dep.info.num_experts} experts, "
        f"{dep.r} replicas on {dep.n} servers ({dep.placement.experts_per_server()} experts per server)"
    )
    if dep.server_cpu_list is not None:
        _log(f"expert servers pinned to CPUs {list(dep.server_cpu_list)} (--server-cpus auto)")
    else:
        _log(f"expert servers not pinned (--server-cpus {dep.server_cpus}{dep.not_pinned_why})")
    try:
        dep.start()
    except ServeInterrupted as exc:
        _log(f"{exc}: stopped (nothing is serving)")
        return 128 + exc.signum
    except ServeError as exc:
        _log(f"start-up failed: {exc}")
        return 1
    try:
        name = Path(dep.model_dir).name
        _log(f"routing table version {dep.routing_table.version}: {dep.table_path}")
        print(
            f"serving {name} on http://{dep.host}:{dep.port} ({dep.n} expert server{'s' if dep.n != 1 else ''}, {dep.r} replicas, "
            f"{dep.m} client{'s' if dep.m != 1 else ''})",
            flush=True,
        )
        return dep.serve_forever()
    finally:
        dep.stop()
