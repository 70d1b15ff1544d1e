"""``native/device_check.sh`` keeps its contract: its step timeouts fit the
5-minute budget, and its pytest step runs every GPU-only test (no ``gpu`` test sits in an
ignored file or matches a deselected name; every deselected name exists)."""

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
    ignored = re.findall(r"--ignore=(\S+)", SCRIPT)
    (kexpr,) = re.findall(r'-k "not \(([^)]*)\)"', SCRIPT)
    deselected = {n.strip() for n in kexpr.split(" or ")}
    files = sorted((ROOT / "tests/gpu").glob("test_*.py"))
    every_test = set()
    for f in files:
        every_test |= {
            n.name
            for n in ast.parse(f.read_text()).body
            if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")
        }
        gpu = _gpu_tests(f)
        if str(f.relative_to(ROOT)) in ignored:
            assert not gpu, f"{f.name} is ignored by device_check.sh but has gpu tests {gpu}"
        hidden = {t for t in gpu if any(d in t for d in deselected)}
        assert not hidden, f"device_check.sh deselects gpu tests {hidden}"
    missing = {d for d in deselected if not any(d in t for t in every_test)}
    assert not missing, f"device_check.sh deselects tests that do not exist: {missing}"
    assert _gpu_tests(ROOT / "tests/gpu/test_overlap_cuda.py")  # the parser finds module marks
