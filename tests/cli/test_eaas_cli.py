"""The ``eaas`` command line as a user meets it: --version, --help, the operator's commands
without torch (the operator image has none), a clear line for a missing extra, and text that
cannot garble a terminal."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from eaas import __version__
from eaas.text import printable

from helpers.cli import run_eaas_all

pytestmark = pytest.mark.timeout(300)

# Runs the CLI in a fresh interpreter where the named modules cannot be imported, and fails if
# any heavy runtime module was imported anyway.
BLOCKED = """
import sys
for name in {blocked!r}:
    sys.modules[name] = None  # `import name` now raises ModuleNotFoundError
sys.argv = ["eaas", *{argv!r}]
from eaas.cli import main
try:
    main()
finally:
    heavy = sorted(m for m in ("torch", "transformers", "numpy", "safetensors") if sys.modules.get(m))
    print("HEAVY:", ",".join(heavy), file=sys.stderr)
"""


def _run(argv: list[str], blocked: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    code = BLOCKED.format(blocked=list(blocked), argv=argv)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)


def test_version():
    r = subprocess.run(
        [sys.executable, "-m", "eaas", "--version"], capture_output=True, text=True, timeout=240
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"eaas {__version__}"


def test_help_gives_an_example_and_says_the_default_model_is_random():
    r = _run(["--help"])
    assert r.returncode == 0, r.stderr
    assert "eaas serve" in r.stdout and "curl" in r.stdout and "second terminal" in r.stdout
    assert "RANDOM" in r.stdout and "~/.cache/eaas/models/" in r.stdout


def test_operator_commands_work_without_torch(tmp_path):
    # numpy is an operator dependency (placement); the runtime's heavy packages are not
    torchless = ("torch", "transformers", "safetensors", "tokenizers", "fastapi")
    r = _run(["crds", "--out", str(tmp_path)], blocked=torchless)
    assert r.returncode == 0, r.stderr
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written and all(n.endswith(".yaml") for n in written), written
    assert _heavy(r.stderr) <= {"numpy"}, r.stderr
    for argv in (["operator", "--help"], ["testbed", "--help"], ["testbed", "env", "--help"]):
        r = _run(argv, blocked=torchless)
        assert r.returncode == 0, (argv, r.stderr)
        assert _heavy(r.stderr) <= {"numpy"}, (argv, r.stderr)


def _heavy(stderr: str) -> set[str]:
    """The heavy modules the ``HEAVY:`` line of :data:`BLOCKED`'s run names."""
    return set(filter(None, stderr.split("HEAVY: ", 1)[1].splitlines()[0].split(",")))


def test_missing_extra_names_the_extra(tmp_path):
    r = _run(["serve", "--port", "1"], blocked=("torch",))
    assert r.returncode == 1
    assert "pip install 'eaas[runtime]'" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    r = _run(["crds", "--out", str(tmp_path)], blocked=("pydantic",))
    assert r.returncode == 1
    assert "'eaas[runtime] or eaas[operator]'" in r.stderr, r.stderr


@pytest.mark.parametrize(
    "raw, shown",
    [
        ("plain text, ünïcode", "plain text, ünïcode"),
        ("a\rb", "a\\rb"),
        ("page\x0cbreak", "page\\fbreak"),
        ("nul\x00byte", "nul\\0byte"),
        ("\x1b[2Jclear", "\\x1b[2Jclear"),
        ("c1\x9bcsi", "c1\\x9bcsi"),
        ("two\nlines\ttab", "two\nlines\ttab"),
    ],
)
def test_printable_escapes_control_characters(raw, shown):
    assert printable(raw) == shown
    assert printable("a\nb\tc", keep_newlines=False) == "a\\nb\\tc"


def test_bad_endpoints_and_tables_exit_2_naming_the_flag(tmp_path):
    """A malformed or unusable --listen (a unix socket in a directory that does not exist
    included) / --http-port of the expert server and an unreadable or
    invalid --routing-table of the attention client: exit 2, one line naming the flag, no
    traceback. The cases run side by side (each is its own interpreter)."""
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{bad")
    missing = tmp_path / "no" / "such" / "dir"
    server = ["expert-server", "--device", "cpu", "--experts", "1:0"]
    cases = [
        ([*server, "--listen", "tcp://127.0.0.1:99999"], "--listen", "port must be 0-65535"),
        ([*server, "--listen", "tcp://no-such-host.invalid:5000"], "--listen", ""),
        ([*server, "--listen", "foo:bar"], "--listen", "unknown scheme"),
        ([*server, "--listen", "unix:"], "--listen", "empty socket path"),
        ([*server, "--listen", f"unix:{missing}/s.sock"], "--listen", "does not exist"),
        ([*server, "--listen", f"cudaipc:{missing}/s.sock"], "--listen", "does not exist"),
        ([*server, "--listen", f"tcp://127.0.0.1:{port}"], "--listen", "in use"),
        ([*server, "--listen", "tcp://127.0.0.1:0", "--cpus", "0-"], "--cpus", "not a CPU"),
        ([*server, "--listen", "tcp://127.0.0.1:0", "--cpus", "4096"], "--cpus", "not available"),
        (
            [*server, "--listen", "tcp://127.0.0.1:0", "--sched-policy", "fifo"],
            "--sched-policy",
            "fifo",
        ),
        (
            [*server, "--listen", "tcp://127.0.0.1:0", "--http-port", str(port)],
            "--http-port",
            "in use",
        ),
        (
            ["attention-client", "--routing-table", str(tmp_path / "none.json"), "--port", "1"],
            "--routing-table",
            "No such file",
        ),
        (
            ["attention-client", "--routing-table", str(bad_json), "--port", "1"],
            "--routing-table",
            "not valid JSON",
        ),
    ]
    try:
        results = run_eaas_all([argv for argv, _, _ in cases])
    finally:
        taken.close()
    for (argv, flag, needle), (code, out) in zip(cases, results, strict=True):
        assert code == 2, (argv, out)
        assert flag in out and needle in out, (argv, out)
        assert "Traceback" not in out, (argv, out)
    assert not (tmp_path / "no").exists()  # a typo creates no directory tree


def test_attention_client_bad_dtype_and_spin_us_exit_2_naming_the_flag(tmp_path):
    """attention-client --dtype float16 was a ValueError traceback (expert-server and serve
    answered a usage error) and --spin-us inf started a client that busy-polls every round trip
    up to --dispatch-timeout (serve's --client-spin-us refuses inf): both exit 2 naming the flag,
    before the routing table (missing here) is looked at."""
    table = str(tmp_path / "none.json")
    cases = [
        (["--dtype", "float16"], "--dtype", "float16"),
        (["--spin-us", "inf"], "--spin-us", "inf"),
    ]
    results = run_eaas_all(
        [["attention-client", "--routing-table", table, "--port", "1", *a] for a, _, _ in cases]
    )
    for (argv, flag, needle), (code, out) in zip(cases, results, strict=True):
        assert code == 2, (argv, out)
        assert flag in out and needle in out, (argv, out)
        assert "Traceback" not in out and "--routing-table" not in out, (argv, out)


def test_listen_on_an_existing_file_that_is_not_a_socket_keeps_the_file(tmp_path):
    """expert-server --listen unix:PATH where PATH is a regular file (a typo for the socket path)
    deleted the file and listened there: it exits 2 naming --listen, and the file is kept. A
    stale socket file is still replaced (tests/runtime/test_transport.py)."""
    existing = tmp_path / "notes.txt"
    existing.write_text("keep me\n")
    server = ["expert-server", "--device", "cpu", "--experts", "1:0"]
    [(code, out)] = run_eaas_all([[*server, "--listen", f"unix:{existing}"]], timeout=120)
    assert code == 2, out
    assert "--listen" in out and "not a socket" in out and "Traceback" not in out, out
    assert existing.read_text() == "keep me\n"


def test_parse_cpu_list_reads_the_linux_list_format():
    from eaas.runtime.cli import parse_cpu_list

    allowed = sorted(os.sched_getaffinity(0))
    assert parse_cpu_list(str(allowed[0])) == {allowed[0]}
    assert parse_cpu_list(f"{allowed[0]}-{allowed[-1]}") == set(range(allowed[0], allowed[-1] + 1))
    assert parse_cpu_list(" , ".join(map(str, allowed))) == set(allowed)
    for bad, needle in [("", "not a CPU"), ("a", "not a CPU"), ("3-1", "not a CPU"),
                        ("-1", "not a CPU"), ("0_1", "not a CPU"), ("+1", "not a CPU"),
                        ("0,,1", "not a CPU"), ("4096", "not available"),
                        # refused before the range is expanded (it ate all memory)
                        ("0-100000000000", "CPU 100000000000 not available")]:  # fmt: skip
        with pytest.raises(ValueError, match=needle):
            parse_cpu_list(bad)


@pytest.mark.api
def test_serve_replicas_errors_name_the_flags():
    """--replicas out of range: exit 2 naming --replicas (and --expert-servers), before torch
    is imported or anything starts."""
    cases = [
        (
            ["--replicas", "5", "--expert-servers", "2"],
            "--replicas (5) cannot exceed --expert-servers (2)",
        ),
        (["--replicas", "0"], "--replicas must be >= 1, got 0"),
        (["--expert-servers", "0", "--replicas", "0"], "--expert-servers must be >= 1, got 0"),
    ]
    for args, message in cases:
        r = _run(["serve", "--port", "1", *args], blocked=("torch",))
        out = " ".join((r.stdout + r.stderr).split())
        assert r.returncode == 2, out
        assert message in out, out
        assert "redundancy" not in out, out
        assert "HEAVY:" in out and "HEAVY: torch" not in out, out


@pytest.mark.api
def test_serve_help_names_the_restart_flags():
    r = _run(["serve", "--help"])
    out = " ".join(r.stdout.split())
    assert r.returncode == 0, r.stderr
    assert "--restart-expert-servers" in out and "--no-restart-expert-servers" in out, out
    assert "--restart-attention-clients" in out and "--no-restart-attention-clients" in out
