"""``eaas serve --engine vllm``'s ``vllm serve`` command line (pure: nothing is started): the
plugin's scheduler by default, the user's ``--scheduler-cls`` from ``--vllm-args`` instead,
and the API key in the environment, never in argv."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from eaas.runtime.options import ServeOptions
from eaas.runtime.options.vllm import SCHEDULER_CLS
from eaas.runtime.serve.vllm_engine import vllm_child

pytestmark = pytest.mark.vllm


def _argv_env(**over):
    o = ServeOptions(engine="vllm", vllm=sys.executable, **over)
    child, env = vllm_child(o, "/models/tiny", Path("/run/t.json"))
    return child.argv, env


def test_the_plugins_scheduler_by_default():
    argv, env = _argv_env(api_key=("sk-one",))
    i = argv.index("--scheduler-cls")
    assert argv[i + 1] == SCHEDULER_CLS == "eaas.vllm.scheduler.Scheduler"
    assert env["VLLM_API_KEY"] == "sk-one" and "sk-one" not in argv


@pytest.mark.parametrize("given", ["--scheduler-cls my.Sched", "--scheduler-cls=my.Sched"])
def test_a_scheduler_in_vllm_args_replaces_it(given):
    argv, _ = _argv_env(vllm_args=f"--enforce-eager {given}")
    assert SCHEDULER_CLS not in " ".join(argv)
    assert " ".join(argv).endswith(f"--enforce-eager {given}")
