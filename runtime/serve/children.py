"""The child processes of one ``eaas serve``: started so that they die with serve
(``PR_SET_PDEATHSIG``), their stdout relayed line by line prefixed with the child's name (and
watched for the ready line), stopped clients first.
"""

from __future__ import annotations

import os
import selectors
import subprocess
import time
from dataclasses import dataclass, field

from eaas.runtime.common.process import die_with_parent
from eaas.text import printable


def log(msg: str) -> None:
    """One line of serve's own output (``[eaas serve] ...``, stdout, flushed)."""
    print(f"[eaas serve] {msg}", flush=True)


@dataclass
class Child:
    """One child process: ``role`` is ``"expert-server"`` or ``"attention-client"``; ``argv`` its
    command line; ``ready`` set once it printed ``<role> ... ready on ...``."""

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
        """The started process. Raises RuntimeError before :meth:`Children.spawn`."""
        if self.proc is None:
            raise RuntimeError(f"{self.name} was not started")
        return self.proc


class Children:
    """The started children and the relay of their stdout (stderr is inherited)."""

    def __init__(self) -> None:
        self.all: list[Child] = []
        self._sel = selectors.DefaultSelector()

    def __iter__(self):
        return iter(self.all)

    def spawn(self, child: Child, env: dict) -> None:
        """Start ``child`` with ``env``; it gets SIGKILL when this process dies."""
        proc = subprocess.Popen(
            child.argv,
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            env=env,
            preexec_fn=die_with_parent(os.getpid()),
            close_fds=True,
        )
        child.proc = proc
        self.all.append(child)
        if proc.stdout is not None:  # always, with stdout=PIPE
            os.set_blocking(proc.stdout.fileno(), False)
            self._sel.register(proc.stdout, selectors.EVENT_READ, child)

    def pump(self, timeout: float) -> None:
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

    def pump_quietly(self, timeout: float) -> None:
        """:meth:`pump`, sleeping instead where a pipe is already closed (while stopping)."""
        try:
            self.pump(timeout)
        except Exception:  # noqa: BLE001  (a closed pipe while stopping: nothing left to relay)
            time.sleep(timeout)

    def kill_all(self) -> None:
        """SIGKILL every child still running."""
        for ch in self.all:
            if ch.proc is not None and ch.proc.poll() is None:
                try:
                    ch.proc.kill()
                except ProcessLookupError:
                    pass

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
                    log(f"{ch.name} did not exit within {grace:.0f} s; killing it")
                    proc.kill()
                proc.wait()
        try:
            self.pump(0)
        except Exception:  # noqa: BLE001
            pass
        for ch in self.all:
            if ch.proc is not None and ch.proc.stdout is not None:
                try:
                    self._sel.unregister(ch.proc.stdout)
                except (KeyError, ValueError):
                    pass
                ch.proc.stdout.close()
        return t0 if alive else None
