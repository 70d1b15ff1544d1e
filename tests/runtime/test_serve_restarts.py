"""``eaas serve``'s pure parts: the restart back-off of a dead expert server, serve's one output
line format, the children's plain log format, and the command line that runs the installed
package even from a folder that holds an ``eaas/`` directory."""

from __future__ import annotations

import logging
import re
import subprocess

import pytest

from eaas import __version__
from eaas.runtime.common.logs import LOG_FORMAT_ENV, PlainFormatter, log_format
from eaas.runtime.serve.children import module_command, output_line
from eaas.runtime.serve.deployment import plural
from eaas.runtime.serve.restarts import MAX_DELAY_S, RESET_AFTER_S, RestartBackoff

pytestmark = pytest.mark.api


def test_backoff_doubles_from_one_second_to_the_cap():
    b = RestartBackoff()
    delays = [b.exited(now=100.0 + i, ready_at=None) for i in range(10)]
    assert delays == [1, 2, 4, 8, 16, 32, 60, 60, 60, 60]
    assert MAX_DELAY_S == 60
    assert b.restart_at == 109.0 + 60


def test_backoff_due_and_restarted():
    b = RestartBackoff()
    assert not b.due(1e9)  # nothing exited
    b.exited(now=10.0, ready_at=None)
    assert not b.due(10.5) and b.due(11.0)
    b.restarted()
    assert not b.due(1e9)


def test_backoff_starts_over_after_serving_long_enough():
    b = RestartBackoff()
    for i in range(4):
        b.exited(now=float(i), ready_at=None)
    assert b.delay() == 8
    # ready for less than RESET_AFTER_S: keeps doubling
    assert b.exited(now=1000.0, ready_at=1000.0 - RESET_AFTER_S + 1) == 16
    # served RESET_AFTER_S or longer before it exited: back to the first delay
    assert b.exited(now=5000.0, ready_at=5000.0 - RESET_AFTER_S) == 1


def test_output_line_has_one_format():
    line = output_line("expert-0", "ready")
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \[expert-0\] ready", line), line
    assert output_line("eaas serve", "gone", "WARNING").endswith("[eaas serve] WARNING: gone")


def test_plural():
    assert [plural(n, "replica") for n in (0, 1, 2)] == ["0 replicas", "1 replica", "2 replicas"]


def test_plain_log_format_and_a_bad_value(monkeypatch):
    fmt = PlainFormatter("%(message)s")

    def rec(level: int) -> logging.LogRecord:
        return logging.LogRecord("eaas.client", level, __file__, 1, "x %d", (1,), None)

    assert fmt.format(rec(logging.INFO)) == "x 1"
    assert fmt.format(rec(logging.WARNING)) == "WARNING: x 1"
    monkeypatch.delenv(LOG_FORMAT_ENV, raising=False)
    assert log_format() == "timestamped"
    monkeypatch.setenv(LOG_FORMAT_ENV, "plain")
    assert log_format() == "plain"
    monkeypatch.setenv(LOG_FORMAT_ENV, "json")
    with pytest.raises(ValueError, match="EAAS_LOG_FORMAT must be timestamped or plain"):
        log_format()


def test_module_command_ignores_an_eaas_folder_in_the_working_directory(tmp_path):
    (tmp_path / "eaas").mkdir()
    for name in ("__init__.py", "__main__.py"):
        (tmp_path / "eaas" / name).write_text('raise SystemExit("decoy eaas imported")\n')
    naive = subprocess.run(
        [module_command("eaas")[0], "-m", "eaas", "--version"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "decoy eaas imported" in naive.stderr  # what `python -m eaas` did: the bug
    r = subprocess.run(
        [*module_command("eaas"), "--version"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert __version__ in r.stdout
