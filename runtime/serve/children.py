"""The child processes of one ``eaas serve``: started so that they die with serve
(``PR_SET_PDEATHSIG``) and so that a folder named ``eaas`` in the working directory cannot
shadow the installed package (:func:`module_command`), their stdout and stderr relayed line by
line in serve's one output format (:func:`output_line`) and watched for the ready line, started
again after an exit (:meth:`Children.respawn`), stopped clients first.

Each child leads a session (and process group) of its own, so a terminal's Ctrl-C reaches serve
alone, which then stops the children in order (clients first); and what a child started itself
(vLLM's EngineCore and resource tracker) is SIGKILLed with it (:meth:`Children.kill_group`)
instead of outliving serve holding its memory.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import IO

from eaas.runtime.common.process import die_with_parent
from eaas.text import printable

#: The source name of serve's own lines (children's lines carry the child's name).
SERVE_SOURCE = "eaas serve"


def output_line(source: str, msg: str, level: str = "") -> str:
    """One line of serve's output: ``YYYY-MM-DD HH:MM:SS [source] [LEVEL: ]msg`` (local time).

    Serve's own lines (``source`` :data:`SERVE_SOURCE`) and every relayed line of a child
    (``source`` its name, e.g. ``expert-0``; the children log without a time stamp of their
    own under serve: ``EAAS_LOG_FORMAT=plain``, :mod:`eaas.runtime.common.logs`) share it.
    ``level`` (``"WARNING"``, ``"ERROR"``) is written before the message; empty for info.
    """
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    return f"{stamp} [{source}] {level + ': ' if level else ''}{msg}"


def log(msg: str, level: str = "") -> None:
    """One line of serve's own output (:func:`output_line` of :data:`SERVE_SOURCE`; stdout,
    flushed)."""
    print(output_line(SERVE_SOURCE, msg, level), flush=True)


def module_command(module: str, python: list[str] | None = None) -> list[str]:
    """The command line that runs ``python -m module`` with this interpreter (or ``python``, an
    interpreter's argv) without putting the working directory first on ``sys.path``
    (``python -m`` does: a folder named like the package there, e.g. a checkout of this
    repository, would be imported instead of the installed package). This interpreter on
    Python 3.11+: ``-P``; 3.10 or another interpreter: a ``-c`` that drops that entry first."""
    if python is None and sys.version_info >= (3, 11):
        return [sys.executable, "-P", "-m", module]
    return [  # Python 3.10, or the vllm command's Python (serve --engine vllm)
        *(python or [sys.executable]),
        "-c",
        f"import runpy, sys; del sys.path[0]; runpy.run_module({module!r}, "
        "run_name='__main__', alter_sys=True)",
    ]


@dataclass
class Child:
    """One child process: ``role`` is ``"expert-server"`` or ``"attention-client"``; ``argv`` its
    command line; ``ready`` set once it printed ``<role> ... ready on ...`` (``ready_at``: its
    ``time.monotonic()``); ``restarts``: how often it was started again after an exit; ``env``:
    the environment it was last started with (a restart reuses it)."""

    name: str
    role: str  # "expert-server" | "attention-client"
    argv: list[str]
    proc: subprocess.Popen | None = None
    ready: bool = False
    ready_at: float | None = None
    server_id: str | None = None
    exit_logged: bool = False
    restarts: int = 0
    extra: dict = field(default_factory=dict)  # per-role facts (a vllm child: its health URLs)
    env: dict = field(default_factory=dict, repr=False)

    @property
    def popen(self) -> subprocess.Popen:
        """The started process. Raises RuntimeError before :meth:`Children.spawn`."""
        if self.proc is None:
            raise RuntimeError(f"{self.name} was not started")
        return self.proc


class Children:
    """The started children and the relay of their stdout and stderr."""

    def __init__(self) -> None:
        self.all: list[Child] = []
        self._sel = selectors.DefaultSelector()
        self._bufs: dict[int, bytes] = {}  # pipe fd -> its unfinished line

    def __iter__(self):
        return iter(self.all)

    def _start(self, child: Child, env: dict) -> None:
        proc = subprocess.Popen(
            child.argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            env=env,
            preexec_fn=die_with_parent(os.getpid()),
            close_fds=True,
            start_new_session=True,  # its own process group: see the module docstring
        )
        child.proc, child.env = proc, env
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:  # always, with PIPE
                os.set_blocking(pipe.fileno(), False)
                self._bufs[pipe.fileno()] = b""
                self._sel.register(pipe, selectors.EVENT_READ, child)

    def spawn(self, child: Child, env: dict) -> None:
        """Start ``child`` with ``env``; it gets SIGKILL when this process dies."""
        self._start(child, env)
        self.all.append(child)

    def respawn(self, child: Child, env: dict | None = None) -> None:
        """Start an exited ``child`` again with the same command line and ``env`` (default: the
        environment of its last start); its last output lines are relayed and its pipes closed
        first; ``ready`` is cleared and ``restarts`` counted."""
        old = child.popen
        for pipe in (old.stdout, old.stderr):
            if pipe is not None and not pipe.closed:  # closed: its end was relayed already
                self._drain(child, pipe)
        child.ready, child.ready_at, child.exit_logged = False, None, False
        child.restarts += 1
        self._start(child, child.env if env is None else env)

    def _drain(self, child: Child, pipe: IO[bytes]) -> None:
        """Relay what is left in ``pipe`` of an exited child, then unregister and close it."""
        fd = pipe.fileno()
        while True:
            try:
                data = os.read(fd, 65536)
            except (BlockingIOError, OSError):
                data = b""
            if not data:
                break
            self._feed(child, fd, data)
        self._close(child, pipe)

    def _close(self, child: Child, pipe: IO[bytes]) -> None:
        fd = pipe.fileno()
        rest = self._bufs.pop(fd, b"")
        if rest:
            self._line(child, rest)
        try:
            self._sel.unregister(pipe)
        except (KeyError, ValueError):
            pass
        pipe.close()

    def _feed(self, child: Child, fd: int, data: bytes) -> None:
        buf = self._bufs.get(fd, b"") + data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            self._line(child, line)
        self._bufs[fd] = buf

    def pump(self, timeout: float) -> None:
        """Relay ready output lines of children (and detect ready lines) for up to ``timeout``."""
        for key, _ in self._sel.select(timeout):
            child: Child = key.data
            pipe: IO[bytes] = key.fileobj  # type: ignore[assignment]
            try:
                data = os.read(key.fd, 65536)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                self._close(child, pipe)
                continue
            self._feed(child, key.fd, data)

    def _line(self, child: Child, raw: bytes) -> None:
        line = raw.decode("utf-8", "replace").rstrip()
        if not child.ready and " ready on " in line and line.startswith(child.role):
            child.ready, child.ready_at = True, time.monotonic()
        print(output_line(child.name, printable(line)), flush=True)  # no raw control chars

    def pump_quietly(self, timeout: float) -> None:
        """:meth:`pump`, sleeping instead where a pipe is already closed (while stopping)."""
        try:
            self.pump(timeout)
        except Exception:  # noqa: BLE001  (a closed pipe while stopping: nothing left to relay)
            time.sleep(timeout)

    @staticmethod
    def kill_group(child: Child) -> None:
        """SIGKILL the process group ``child`` leads: the child if still running, and every
        process it started that is left in its group (its pid is the group's id; a group
        whose members are all gone is ignored)."""
        if child.proc is None:
            return
        try:
            os.killpg(child.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def kill_all(self) -> None:
        """SIGKILL every child still running, with what it started (:meth:`kill_group`)."""
        for ch in self.all:
            self.kill_group(ch)

    def stop(self, grace: float) -> float | None:
        """Terminate the clients (SIGTERM) and wait for them, then the servers; SIGKILL what is
        left after ``grace`` seconds (in all); close the pipes. Returns the ``time.monotonic()``
        the stop began at when some child was still running (None: none was)."""
        alive = [ch for ch in self.all if ch.proc is not None and ch.proc.poll() is None]
        if alive:
            clients = sum(ch.role == "attention-client" for ch in alive)
            servers = len(alive) - clients
            log(
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
            group = [ch for ch in self.all if ch.role == role and ch.proc is not None]
            for ch in group:
                if ch.proc is not None and ch.proc.poll() is None:
                    try:
                        ch.proc.terminate()
                    except ProcessLookupError:
                        pass
            for ch in group:
                proc = ch.popen
                while proc.poll() is None and time.monotonic() < deadline:
                    self.pump_quietly(0.1)  # relay their last lines while they stop
                if proc.poll() is None:
                    log(f"{ch.name} did not exit within {grace:.0f} s; killing it", "WARNING")
                # the child if still running, and what it started and left (vLLM's EngineCore)
                self.kill_group(ch)
                proc.wait()
        for ch in self.all:
            if ch.proc is None:
                continue
            for pipe in (ch.proc.stdout, ch.proc.stderr):
                if pipe is not None and not pipe.closed:
                    self._drain(ch, pipe)
        return t0 if alive else None
