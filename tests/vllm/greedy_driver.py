"""Run by the vLLM venv's python (not pytest): greedy generations of several models in one
process with vLLM's offline ``LLM`` (engine and worker in this process: one vLLM import for all
of them), with or without the eaas.vllm plugin.

``python greedy_driver.py JOB.json OUT.json``; JOB: ``{"prompts": [[ids]], "max_tokens": n,
"runs": [{"name", "model", "env": {EAAS_*} | null, "llm": {more LLM(...) arguments}}]}``. A run with ``env`` enables the plugin
for that model (``EAAS_*`` set while it loads; the process's plugin client is reset between
models); runs without ``env`` are vLLM alone (then the process must run with
``VLLM_PLUGINS=""`` or without any ``env`` run, as the plugin registers once per process).
OUT: ``{name: {"ids": [[...]], "pss_kib": n, "routed_param_bytes": n, "skipped_bytes": n}}``.
"""

from __future__ import annotations

import gc
import json
import os
import sys


def pss_kib() -> int:
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("Pss:"):
            return int(line.split()[1])
    return -1


def routed_bytes(model) -> list[int]:
    """[bytes of RoutedExperts parameters, checkpoint bytes the plugin skipped]."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    params = skipped = 0
    for m in model.modules():
        if isinstance(m, RoutedExperts):
            params += sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
            skipped += int(getattr(m, "eaas_skipped_bytes", 0))
    return [params, skipped]


def main() -> int:
    job = json.load(open(sys.argv[1]))
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    out: dict = {}
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in job["prompts"]]
    for run in job["runs"]:
        for k in [k for k in os.environ if k.startswith("EAAS_")]:
            del os.environ[k]
        os.environ.update(run.get("env") or {})
        if run.get("env"):
            from eaas.vllm.client import ExpertClient

            ExpertClient.reset()
        llm = LLM(
            model=run["model"],
            dtype="float32",
            enforce_eager=True,
            max_model_len=256,
            max_num_seqs=16,
            seed=0,
            distributed_executor_backend="uni",
            **run.get("llm", {}),
        )
        gc.collect()
        pss = pss_kib()
        sizes = llm.apply_model(routed_bytes)[0]
        res = llm.generate(prompts, params, use_tqdm=False)
        out[run["name"]] = {
            "ids": [list(r.outputs[0].token_ids) for r in res],
            "pss_kib": pss,
            "routed_param_bytes": sizes[0],
            "skipped_bytes": sizes[1],
        }
        print(f"{run['name']}: {out[run['name']]['ids'][0][:8]} PSS {pss} KiB", flush=True)
        del llm
        gc.collect()
    json.dump(out, open(sys.argv[2], "w"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
