"""Suite-wide settings: each test's tier marker, the checkpoint fixtures, and which tests share
one pytest-xdist worker.

**Tiers.** A test's tier is its top folder under ``tests/`` (:data:`TIERS`); the hook
:func:`pytest_collection_modifyitems` adds that marker, so ``pytest -m unit`` (or ``e2e``, ``k8s``,
``cluster``, ``gpu_cpu``, ``vllm``) selects a tier. Feature markers (``engine``, ``elastic``) and ``gpu`` (the
tests that need a CUDA GPU) are set on the tests themselves.

**Checkpoints.** The tiny checkpoints are built once per session (:func:`model_dir`,
:func:`tokenizer`, :func:`checkpoints`).

**Workers.** The README's test command runs the suite on two pytest-xdist workers (``-n 2`` in
pyproject.toml's ``addopts``): most tests wait on processes and control-plane state, not on the
CPU, so two workers cut the wall time on a 2-core machine (three took longer: 18:27 against
15:51, the cluster tier slowed by the load). :class:`ModuleScheduling` decides who runs what:

* each control-plane tier (``tests/k8s``: kube-apiserver + etcd + kwok; ``tests/cluster``:
  the testbed with process nodes) is ONE unit, run whole in collection order on one worker
  with its own session-scoped testbed (stopped after the tier's last test,
  :class:`helpers.tier.TierTestbed`); the two testbeds may run side by side, one per worker
  (own state dirs, ports and pod networks);
* modules that share one session-scoped deployment are one unit (:data:`_SHARED`: the API
  parity, logprobs and structured-output modules and their ``eaas serve``), so it starts once;
* every other module is a unit of its own: it runs whole on one worker, in its order, with its
  module-scoped fixtures (an ``eaas serve`` shared by a module's tests) set up once.

The cluster tier is the longest unit, then the k8s tier: they are handed out first
(:data:`_FIRST`), the modules after them by test count (xdist's order), so the worker with the
k8s tier takes the other modules while the cluster tier runs.

``pytest -n 0`` runs the whole suite in one process. (xdist's ``--dist loadgroup`` would express
this with ``xdist_group`` marks, but with pytest 9 the group suffix it adds to a test's node id
does not reach the scheduler, so the units are defined here instead.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
from xdist.scheduler import LoadScopeScheduling

from eaas.runtime.models.tiny import default_model_dir

from helpers.checkpoints import small_mixtral, small_qwen3

#: control-plane tiers: folder -> work unit (each runs whole on one worker)
_CONTROL_PLANE = {"tests/cluster/": "cluster", "tests/k8s/": "k8s"}
#: modules -> the unit they share (one session-scoped deployment, tests/e2e/conftest.py)
_SHARED = {
    "tests/e2e/test_api_parity.py": "api-parity",
    "tests/e2e/test_api_logprobs.py": "api-parity",
    "tests/e2e/test_api_structured.py": "api-parity",
}
#: units handed out before the others, longest first
_FIRST = ("cluster", "k8s")

TESTS = Path(__file__).resolve().parent
#: top folder under tests/ -> the tier marker its tests get (declared in pyproject.toml)
TIERS = {
    "runtime": "unit",
    "client": "unit",
    "operator": "unit",
    "cli": "unit",
    "repo": "unit",
    "e2e": "e2e",
    "k8s": "k8s",
    "cluster": "cluster",
    "gpu": "gpu_cpu",
    "vllm": "vllm",
}


def pytest_collection_modifyitems(config, items):
    """Add the tier marker of each test's top folder (:data:`TIERS`)."""
    for item in items:
        path = Path(item.path).resolve()
        if TESTS not in path.parents:
            continue
        top = path.relative_to(TESTS).parts[0]
        if top not in TIERS:  # every test has a tier: a new folder is declared here first
            raise pytest.UsageError(f"tests/{top}: no tier marker for this folder (TIERS)")
        item.add_marker(TIERS[top])


class ModuleScheduling(LoadScopeScheduling):
    """xdist's load-by-scope scheduler with the units above: ``"cluster"`` and ``"k8s"`` for
    the control-plane tiers, :data:`_SHARED`'s unit for modules that share a deployment, the
    module's path for any other test (node ids are relative to
    the repository root, e.g. ``tests/e2e/test_push.py::test_version_1_in_use``)."""

    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        for folder, unit in _CONTROL_PLANE.items():
            if path.startswith(folder):
                return unit
        return _SHARED.get(path, path)

    def _assign_work_unit(self, node) -> None:
        for unit in reversed(_FIRST):  # the longest units first
            if unit in self.workqueue:
                self.workqueue.move_to_end(unit, last=False)
        super()._assign_work_unit(node)


def pytest_xdist_make_scheduler(config, log):
    return ModuleScheduling(config, log)


# ---- checkpoints (built once per session) ------------------------------------------------------


@pytest.fixture(scope="session")
def model_dir() -> str:
    """The built-in tiny DeepSeek-V3 checkpoint (``eaas tiny-model``'s, built once and cached)."""
    return str(default_model_dir())


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    """The tiny checkpoint's tokenizer (transformers ``AutoTokenizer``)."""
    # lazy: transformers takes seconds to import, and only the tests that use it pay for it
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory, model_dir) -> dict[str, str]:
    """One tiny checkpoint per supported architecture: ``{model_type: directory}``
    (``deepseek_v3``: the built-in tiny model; ``qwen3_moe`` and ``mixtral``:
    :mod:`helpers.checkpoints`' with its tokenizer)."""
    tiny = Path(model_dir)
    return {
        "deepseek_v3": model_dir,
        "qwen3_moe": str(small_qwen3(tmp_path_factory.mktemp("qwen3"), tiny)),
        "mixtral": str(small_mixtral(tmp_path_factory.mktemp("mixtral"), tiny)),
    }
