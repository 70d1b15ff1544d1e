"""The repository's layout rules (docs/architecture.md, "Code map"): every product file stays
small, the package list of pyproject.toml is the tree's, and nothing points outside the
repository. The import rules themselves are checked by ``.ci/lint-imports`` (import-linter)."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
#: source folder -> the package it is installed as (pyproject.toml [tool.setuptools.package-dir])
SOURCES = {
    "eaas": "eaas",
    "runtime": "eaas.runtime",
    "operator": "eaas.operator",
    "testbed": "eaas.testbed",
    "native": "eaas.native",
    "vllm_plugin": "eaas.vllm",
}
MAX_LINES = 600


def _product_files(suffixes: tuple[str, ...] = (".py",)) -> list[Path]:
    return sorted(
        p
        for folder in SOURCES
        for p in (ROOT / folder).rglob("*")
        if p.suffix in suffixes and "__pycache__" not in p.parts
    )


def test_no_product_file_over_600_lines():
    long = {
        str(p.relative_to(ROOT)): n
        for p in _product_files()
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"split these files (one concern per file, <= {MAX_LINES} lines): {long}"


def test_setuptools_lists_every_package_of_the_tree():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert cfg["package-dir"] == {v: k for k, v in SOURCES.items()}
    tree = {
        ".".join([pkg, *init.parent.relative_to(ROOT / folder).parts])
        for folder, pkg in SOURCES.items()
        for init in (ROOT / folder).rglob("__init__.py")
    }
    assert set(cfg["packages"]) == tree


def test_code_and_docs_point_at_nothing_outside_the_repository():
    """No design brief outside the repository and no issue numbers: the code says the thing."""
    texts = _product_files((".py", ".cu", ".sh")) + sorted((ROOT / "docs").rglob("*.md"))
    texts += [ROOT / "README.md", ROOT / "deploy/README.md"]
    hits = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
        for p in texts
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"DESIGN\.md|\bissues? #?\d+\b", line, re.I)
    ]
    assert not hits, "\n".join(hits)
