"""One testbed per control-plane tier (``tests/k8s``, ``tests/cluster``) and pytest-xdist worker:
started by the tier's session-scoped fixture, stopped right after the tier's last test on that
worker, so it does not idle beside the other modules that worker runs next.

Each tier runs whole, in collection order, on one worker (tests/conftest.py), so its tests are
consecutive there and "no test of the tier follows" is known from pytest's ``nextitem``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from helpers.k8s import running_testbed


class TierTestbed:
    """The testbed of the tier whose tests live under ``tier_dir``.

    Args:
        tier_dir: the tier's folder (its conftest's ``Path(__file__).parent``).
    """

    def __init__(self, tier_dir: Path) -> None:
        self.tier_dir = tier_dir.resolve()
        self._stack: contextlib.ExitStack | None = None

    def start(self, tmp_path_factory: Any, label: str, **up: Any) -> Any:
        """Start it (:func:`helpers.k8s.running_testbed` with ``up``); returns the testbed."""
        stack = contextlib.ExitStack()
        tb = stack.enter_context(running_testbed(tmp_path_factory, label, **up))
        self._stack = stack
        return tb

    def stop(self) -> None:
        """Stop it if it runs (idempotent); a process it leaves behind fails here."""
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()

    def after_test(self, nextitem: Any) -> None:
        """From the tier's ``pytest_runtest_teardown`` (after the module-scoped fixtures are
        torn down): stop when no test of the tier follows on this worker."""
        if nextitem is None or self.tier_dir not in Path(nextitem.path).resolve().parents:
            self.stop()
