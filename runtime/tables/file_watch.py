"""The routing table from a JSON file: :class:`RoutingTableWatcher` polls it and hands newer
versions to the attention client's dispatcher.

The file is a routing table in the wire format of :mod:`eaas.runtime.tables` (e.g. a
Kubernetes ConfigMap mounted as a volume).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Protocol

from eaas.runtime.tables.table import RoutingTable
from eaas.runtime.tables.wire import RoutingTableError

log = logging.getLogger("eaas.client.dispatch")


class TableReceiver(Protocol):
    """What the watcher feeds (the attention client's ``Dispatcher``)."""

    @property
    def table(self) -> RoutingTable | None:
        """The routing table in use (None before the first)."""
        ...

    @property
    def version(self) -> int:
        """Version of the routing table in use (0 = none yet)."""
        ...

    def set_table(self, table: RoutingTable) -> bool:
        """Apply ``table`` if strictly newer; True if applied."""
        ...

    def reconnect_down(self) -> int:
        """Retry the expert servers that are down and due."""
        ...


class RoutingTableWatcher:
    """Polls a routing-table JSON file and hands newer versions to a dispatcher.

    Changes are detected by ``(mtime_ns, size, inode)`` of the path (a Kubernetes ConfigMap mount
    swaps a symlink, which changes the inode). Malformed files are logged and ignored (the table
    in use stays). Each poll also calls the receiver's ``reconnect_down``.

    Args:
        path: JSON file (see :mod:`eaas.runtime.tables`).
        dispatcher: receiver (:class:`TableReceiver`).
        interval: poll period in seconds.
    """

    def __init__(self, path: str, dispatcher: TableReceiver, interval: float = 0.5):
        self.path = path
        self.dispatcher = dispatcher
        self.interval = interval
        self._sig: tuple | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def load_now(self) -> bool:
        """Read the file once; returns True if a new table was applied.

        Raises:
            OSError / RoutingTableError: only if no table is in use yet (startup must fail loudly).
        """
        try:
            st = os.stat(self.path)
            sig = (st.st_mtime_ns, st.st_size, st.st_ino)
            if sig == self._sig:
                return False
            with open(self.path, encoding="utf-8") as f:
                text = f.read()
            table = RoutingTable.from_json(text)
        except (OSError, RoutingTableError) as exc:
            if self.dispatcher.table is None:
                raise
            log.warning(
                "routing table %s unreadable, keeping version %d: %s",
                self.path,
                self.dispatcher.version,
                exc,
            )
            return False
        self._sig = sig
        return self.dispatcher.set_table(table)

    def start(self) -> None:
        """Poll every ``interval`` seconds on a daemon thread until :meth:`stop`."""
        self._thread = threading.Thread(target=self._run, name="eaas-routing-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.load_now()
                self.dispatcher.reconnect_down()
            except Exception:  # noqa: BLE001
                log.exception("routing table poll failed")

    def stop(self) -> None:
        """Stop polling (waits at most 2 s for the thread)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)
