"""The log format of the serving processes (attention client, expert server).

Standalone (a pod, a terminal) each line carries its time stamp and process:
``2026-01-02 03:04:05,678 client-0 eaas.client INFO message``. Under ``eaas serve``, which
relays every child's lines with its own time stamp and the child's name, the children log
plain (``EAAS_LOG_FORMAT=plain``): the message alone, ``WARNING: message`` (or ``ERROR``,
``CRITICAL``) for what is worse than info, so all of serve's output has one format.
"""

from __future__ import annotations

import logging
import os
import sys

#: Environment variable choosing the log format: ``timestamped`` (default) or ``plain``.
LOG_FORMAT_ENV = "EAAS_LOG_FORMAT"
LOG_FORMATS = ("timestamped", "plain")


class PlainFormatter(logging.Formatter):
    """``message`` for info and below, ``LEVEL: message`` above (a traceback follows as usual)."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return f"{record.levelname}: {text}" if record.levelno > logging.INFO else text


def log_format() -> str:
    """The format :data:`LOG_FORMAT_ENV` asks for (unset or empty: ``timestamped``).

    Raises:
        ValueError: another value (the message names the variable).
    """
    value = os.environ.get(LOG_FORMAT_ENV, "") or "timestamped"
    if value not in LOG_FORMATS:
        raise ValueError(f"{LOG_FORMAT_ENV} must be timestamped or plain, got {value!r}")
    return value


def configure_logging(process: str, level: int = logging.INFO) -> None:
    """Send the root logger's records of ``level`` and above to stderr in the format of
    :func:`log_format`; ``process`` (e.g. ``client-0``) names this process in timestamped
    lines. A no-op where the root logger already has a handler (``logging.basicConfig``).

    Raises:
        ValueError: a bad :data:`LOG_FORMAT_ENV`.
    """
    handler = logging.StreamHandler(sys.stderr)
    if log_format() == "plain":
        handler.setFormatter(PlainFormatter("%(message)s"))
    else:
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s {process} %(name)s %(levelname)s %(message)s")
        )
    logging.basicConfig(level=level, handlers=[handler])
