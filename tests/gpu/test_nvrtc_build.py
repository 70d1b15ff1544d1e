"""NVRTC builds every native/ kernel for sm_90 and sm_100 on the CPU (no GPU, no nvcc)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from eaas.runtime.cuda import nvrtc as nb

KERNELS = {
    "eaas_experts.cu": [
        "eaas_moe_route",
        "eaas_grouped_gate_up_f32",
        "eaas_grouped_gate_up_bf16",
        "eaas_grouped_down_f32",
        "eaas_grouped_down_bf16",
        "eaas_combine_f32",
        "eaas_combine_bf16",
    ],
    "eaas_signal.cu": ["eaas_signal_flag", "eaas_wait_flag", "eaas_bump_and_signal"],
}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EAAS_CACHE_DIR", str(tmp_path))
    return tmp_path / "native"


def test_sources_found_and_listed():
    d = nb.native_dir()
    assert sorted(p.name for p in d.glob("*.cu")) == sorted(nb.SOURCES) == sorted(KERNELS)


@pytest.mark.parametrize("arch", nb.DEFAULT_ARCHS)
@pytest.mark.parametrize("source", nb.SOURCES)
def test_every_kernel_compiles_to_cubin(source, arch, cache):
    b = nb.build(source, arch)
    assert not b.cached and b.path.parent == cache
    data = b.path.read_bytes()
    assert data[:4] == b"\x7fELF"  # a cubin is an ELF image of SASS for exactly this arch
    for k in KERNELS[source]:
        assert k.encode() in data, f"kernel {k} missing from the {arch} cubin of {source}"


def test_cache_hit_and_key(cache):
    a = nb.build("eaas_signal.cu", "sm_90")
    b = nb.build("eaas_signal.cu", "sm_90")
    c = nb.build("eaas_signal.cu", "sm_100")
    assert not a.cached and b.cached and b.path == a.path
    assert c.path != a.path and not c.cached
    assert sorted(p.name for p in cache.iterdir()) == sorted([a.path.name, c.path.name])


def test_compile_error_carries_nvrtc_log():
    with pytest.raises(nb.NvrtcError, match=r"broken\.cu.*sm_90[\s\S]*undefined"):
        nb.compile_cubin(
            'extern "C" __global__ void k(int* x) { x[0] = not_declared; }', "broken.cu", "sm_90"
        )
    with pytest.raises(nb.NvrtcError, match="cannot target sm_1"):
        nb.compile_cubin('extern "C" __global__ void k() {}', "k.cu", "sm_1")


def test_gpu_modules_import_without_cuda():
    """CPU-only installs: importing the GPU modules loads no CUDA module beyond what torch
    itself imports, no nvshmem4py, and initialises no CUDA context."""
    code = (
        "import sys, torch\n"
        "base = set(sys.modules)\n"
        "import eaas.runtime.cuda, eaas.runtime.cuda.nvrtc, eaas.runtime.server.grouped\n"
        "import eaas.runtime.client.overlap, eaas.runtime.client.graphs, eaas.native.device_check\n"
        "import eaas.runtime.transport.cuda_ipc, eaas.runtime.transport.nvshmem\n"
        "import eaas.runtime.server.main\n"
        "new = [m for m in set(sys.modules) - base if m.startswith(('cuda', 'nvshmem', 'nvidia'))]\n"
        "assert not new, new\n"
        "assert not torch.cuda.is_initialized()\n"
    )
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr


def test_device_check_without_gpu_says_so(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    r = subprocess.run(
        [sys.executable, "-m", "eaas.native.device_check", "--out", str(tmp_path / "t.md")],
        capture_output=True,
        text=True,
        env=env,
    )
    assert r.returncode == 2 and "no CUDA device" in r.stderr
    script = nb.native_dir() / "device_check.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    assert os.access(script, os.X_OK)
