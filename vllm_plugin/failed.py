"""The requests the plugin's scheduler ended because an expert they needed had no live replica:
the channel from vLLM's engine-core process (the scheduler, :mod:`eaas.vllm.scheduler`) to its
API server process (the middleware that answers them with HTTP 503,
:mod:`eaas.vllm.middleware`).

vLLM 0.32 carries a request's end to the API server as ``finish_reason`` ``error`` and nothing
else (its completion and chat serving turn every ``error`` into ``GenerationError("Internal
server error")``, HTTP 500), so the cause travels beside it: the scheduler appends the engine
request ids it ends to one small file per vLLM instance, *before* it returns the step's outputs
(so before the API server can see the error), and the middleware reads it when a response is a
500 or a stream's error event. Its directory is ``EAAS_FAILED_REQUESTS_DIR``: the plugin sets it
in vLLM's first process when unset (:func:`eaas.vllm.register`, :func:`default_dir`), before
vLLM starts its engine core, so the API server and the engine core, which inherit that
environment, name the same file; both run on one host (the plugin refuses data parallelism).
Torch- and vLLM-free.

Format: one engine request id per line (vLLM's internal id: the API's id, ``cmpl-<base>-<i>``
or ``chatcmpl-<base>``, plus ``-`` and 8 random hex digits; ``<n>_`` in front for a child of a
request with ``n > 1``). Past :data:`ROTATE_BYTES` the file moves to ``<name>.1`` (the one
before that is dropped).
"""

from __future__ import annotations

import os
import re
import tempfile
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path

from eaas.runtime.options.vllm import ENV

#: size (bytes) past which the record file is rotated (about 15,000 request ids)
ROTATE_BYTES = 1 << 20
_NAME = "no-live-replica"


def default_dir(pid: int | None = None) -> Path:
    """A new record directory for the vLLM whose first process is ``pid`` (default: this
    process): under the temp dir, private to the user, unique per start."""
    pid = os.getpid() if pid is None else pid
    return (
        Path(tempfile.gettempdir()) / f"eaas-vllm-{os.getuid()}" / f"{pid}-{uuid.uuid4().hex[:8]}"
    )


class FailedRequests:
    """One vLLM's record of the requests ended for a missing expert.

    Args:
        directory: the record's directory (``EAAS_FAILED_REQUESTS_DIR``; created on the first
            :meth:`add`).
    """

    def __init__(self, directory: str | Path):
        self.path = Path(directory) / _NAME

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> FailedRequests | None:
        """The record ``EAAS_FAILED_REQUESTS_DIR`` names (None: not set, the plugin is off)."""
        d = environ.get(ENV["failed_requests_dir"], "").strip()
        return cls(d) if d else None

    def add(self, request_ids: Iterable[str]) -> None:
        """Append engine request ids (written and closed before this returns).

        Raises:
            OSError: the temp dir is not writable.
        """
        lines = "".join(f"{r}\n" for r in request_ids if "\n" not in r)
        if not lines:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            if self.path.stat().st_size > ROTATE_BYTES:
                os.replace(self.path, self.path.with_name(_NAME + ".1"))
        except FileNotFoundError:
            pass
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(lines)

    def ids(self) -> list[str]:
        """Every recorded id (the rotated file's first); [] when there is no record."""
        out: list[str] = []
        for p in (self.path.with_name(_NAME + ".1"), self.path):
            try:
                out += p.read_text(encoding="utf-8").splitlines()
            except FileNotFoundError:
                pass
        return out

    def holds(self, base_id: str, chat: bool) -> bool:
        """Whether a request of the API request id ``base_id`` (the ``X-Request-Id`` header or
        the body's ``request_id``) is recorded: ``cmpl-<base>-<prompt index>`` (a completion)
        or ``chatcmpl-<base>`` (``chat``), with vLLM's random suffix and child prefix."""
        api = rf"chatcmpl-{re.escape(base_id)}" if chat else rf"cmpl-{re.escape(base_id)}-\d+"
        pattern = re.compile(rf"(?:\d+_)?{api}(?:-[0-9a-f]{{8}})?")
        return any(pattern.fullmatch(r) for r in self.ids())
