"""``native/device_check.sh`` keeps its contract: its step timeouts fit the
5-minute budget, and its pytest step runs every GPU-only test (selected by the ``gpu`` mark,
nothing ignored or deselected)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = (ROOT / "native/device_check.sh").read_text()


def _gpu_tests(path: Path) -> set[str]:
    """Names of the test functions of ``path`` that carry the ``gpu`` mark (or whose module
    does)."""
    tree = ast.parse(path.read_text())
    src = path.read_text()
    module_gpu = re.search(r"pytestmark\s*=.*pytest\.mark\.gpu\b(?!_)", src) is not None
    out = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            marks = {ast.unparse(d) for d in node.decorator_list}
            if module_gpu or any(re.search(r"mark\.gpu\b(?!_)", m) for m in marks):
                out.add(node.name)
    return out


def test_step_timeouts_fit_five_minutes():
    steps = [int(t) for t in re.findall(r"^\s*timeout (\d+) ", SCRIPT, re.M)]
    assert len(steps) == 3, steps
    assert sum(steps) <= 295, f"step timeouts {steps} sum to {sum(steps)} s (budget 300 s)"


def test_pytest_step_runs_every_gpu_test():
    """The pytest step selects by the ``gpu`` mark alone (every other test of tests/gpu runs in
    CI on the CPU): no file ignored, no name deselected, and there are gpu tests to select."""
    (step,) = [line for line in SCRIPT.splitlines() if "-m pytest" in line]
    assert re.search(r"-m gpu\b(?!_)", step), step
    assert "--ignore" not in SCRIPT and not re.search(r"\s-k\s", SCRIPT)
    files = sorted((ROOT / "tests/gpu").glob("test_*.py"))
    assert sum(len(_gpu_tests(f)) for f in files) >= 5
    assert _gpu_tests(ROOT / "tests/gpu/test_overlap_cuda.py")  # the parser finds module marks
