"""Build the ``native/*.cu`` kernels with NVRTC (cuda-python) and cache the cubins.

No nvcc at run time: the sources ship as package data (``eaas.native``) and are compiled on first
use through ``cuda.bindings.nvrtc``. Output is **cubin** (SASS for one exact architecture, no
PTX JIT at load time) for each target; the default targets are ``sm_90`` (H100/H200) and
``sm_100`` (B200). The compile itself needs no GPU, so CI checks it on the CPU
(``tests/gpu/test_nvrtc_build.py``).

Cache: ``$EAAS_CACHE_DIR/native/`` (default ``~/.cache/eaas/native/``), one file per
``(source, arch, NVRTC version, options)``, named ``{stem}-{arch}-{sha256[:16]}.cubin``; the
key is the SHA-256 of all four, so an edited source, another GPU or another CUDA release never
reuses a stale binary. Writes are atomic (temp file + rename): concurrent processes are safe.

Where ``libnvrtc`` comes from: PyPI's torch depends on ``cuda-toolkit[nvrtc,...]``, which
installs the ``nvidia-cuda-nvrtc`` wheel (``site-packages/nvidia/cu13/lib/libnvrtc.so.13``);
``cuda-bindings`` (cuda-python) provides the Python API. When cuda-python's own library search
misses that directory (it only looks in the interpreter's own site-packages), this module
preloads the library from every ``nvidia`` package path.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import sys
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from importlib.resources import files
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from eaas.runtime.cuda import GpuUnavailableError

DEFAULT_ARCHS = ("sm_90", "sm_100")
SOURCES = ("eaas_experts.cu", "eaas_signal.cu")
_OPTIONS = ("-std=c++17", "--device-as-default-execution-space")


class NvrtcError(RuntimeError):
    """NVRTC rejected a source; the message holds NVRTC's log."""


def native_dir() -> Path:
    """Directory holding the ``.cu`` sources: package data ``eaas.native`` when installed, else
    ``native/`` at the repository root (an editable checkout installed before the package
    existed). Raises FileNotFoundError when neither holds them."""
    cands: list[Path] = []
    try:
        cands.append(Path(str(files("eaas.native"))))
    except (ModuleNotFoundError, TypeError):
        pass
    cands.append(Path(__file__).resolve().parents[2] / "native")
    for d in cands:
        if all((d / s).is_file() for s in SOURCES):
            return d
    raise FileNotFoundError(f"EaaS native sources {SOURCES} not found in {[str(c) for c in cands]}")


def cache_dir() -> Path:
    """``$EAAS_CACHE_DIR/native`` if set, else ``~/.cache/eaas/native``."""
    root = os.environ.get("EAAS_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "eaas"
    )
    return Path(root) / "native"


def _nvidia_dirs(sub: str) -> list[str]:
    try:
        # optional: the nvidia-* wheels (namespace package) exist only with the CUDA extras
        import nvidia
    except ImportError:
        return []
    out = []
    for base in list(getattr(nvidia, "__path__", [])):
        for pkg in ("cu13", "cu12", "cuda_nvrtc", "cuda_runtime"):
            d = os.path.join(base, pkg, sub)
            if os.path.isdir(d):
                out.append(d)
    return out


@lru_cache(maxsize=1)
def nvrtc():
    """The ``cuda.bindings.nvrtc`` module with ``libnvrtc`` loaded.

    Raises:
        GpuUnavailableError: cuda-python is not installed or no ``libnvrtc`` can be found.
    """
    try:
        # optional dependency (cuda-python): importing this module must not need it
        from cuda.bindings import nvrtc as _nvrtc
    except ImportError as e:
        raise GpuUnavailableError(
            f"cuda-python is not installed ({e}); pip install 'eaas[gpu]' or 'eaas[test]'"
        ) from None
    try:
        _nvrtc.nvrtcVersion()
        return _nvrtc
    except Exception:  # cuda.pathfinder's DynamicLibNotFoundError (or RuntimeError) - preload
        pass
    for d in _nvidia_dirs("lib"):
        for lib in sorted(glob.glob(os.path.join(d, "libnvrtc.so.*")), reverse=True):
            if "builtins" in lib:
                continue
            try:
                ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            try:
                _nvrtc.nvrtcVersion()
                return _nvrtc
            except Exception:
                continue
    raise GpuUnavailableError(
        "libnvrtc not found: install the nvidia-cuda-nvrtc wheel (torch's cuda-toolkit[nvrtc])"
    )


def nvrtc_version() -> tuple[int, int]:
    """``(major, minor)`` of the loaded NVRTC."""
    err, major, minor = nvrtc().nvrtcVersion()
    _check(err, "nvrtcVersion")
    return int(major), int(minor)


def supported_archs() -> list[str]:
    """Architectures this NVRTC can target, as ``sm_XY`` strings."""
    err, archs = nvrtc().nvrtcGetSupportedArchs()
    _check(err, "nvrtcGetSupportedArchs")
    return [f"sm_{a}" for a in archs]


def _check(err, what: str) -> None:
    if int(err) != 0:
        _, s = nvrtc().nvrtcGetErrorString(err)
        raise NvrtcError(f"{what}: {s.decode() if isinstance(s, bytes) else s}")


def _options(arch: str) -> list[bytes]:
    opts = [f"--gpu-architecture={arch}", *_OPTIONS]
    # cuda_bf16.h: NVRTC's builtin copy, else the nvidia-cuda-runtime wheel's include dir
    opts += [f"-I{d}" for d in _nvidia_dirs("include")]
    return [o.encode() for o in opts]


def compile_cubin(source: str, name: str, arch: str) -> bytes:
    """Compile one CUDA source to a cubin with NVRTC (no cache).

    Args:
        source: CUDA C++ text (kernels ``extern "C"``).
        name: file name for NVRTC's messages.
        arch: ``sm_XY`` target.

    Returns:
        the cubin (ELF) bytes.

    Raises:
        NvrtcError: compile error (message holds NVRTC's log) or unknown ``arch``.
        GpuUnavailableError: no NVRTC here.
    """
    nv = nvrtc()
    if arch not in supported_archs():
        raise NvrtcError(f"NVRTC {nvrtc_version()} cannot target {arch}: {supported_archs()}")
    err, prog = nv.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], [])
    _check(err, "nvrtcCreateProgram")
    try:
        opts = _options(arch)
        (err,) = nv.nvrtcCompileProgram(prog, len(opts), opts)
        if int(err) != 0:
            _, n = nv.nvrtcGetProgramLogSize(prog)
            log = b" " * n
            nv.nvrtcGetProgramLog(prog, log)
            raise NvrtcError(
                f"NVRTC failed on {name} for {arch}:\n{log.decode(errors='replace').strip()}"
            )
        err, n = nv.nvrtcGetCUBINSize(prog)
        _check(err, "nvrtcGetCUBINSize")
        cubin = b" " * n
        (err,) = nv.nvrtcGetCUBIN(prog, cubin)
        _check(err, "nvrtcGetCUBIN")
        return cubin
    finally:
        nv.nvrtcDestroyProgram(prog)


@dataclass(frozen=True)
class Built:
    """One cached build: ``path`` of the cubin, ``cached`` True when it was already there."""

    source: str
    arch: str
    path: Path
    cached: bool


def build(source_file: str, arch: str, *, force: bool = False) -> Built:
    """Cubin of ``native/<source_file>`` for ``arch``, from the cache or freshly compiled.

    Raises:
        NvrtcError, GpuUnavailableError, FileNotFoundError.
    """
    src = (native_dir() / source_file).read_text()
    ver = nvrtc_version()
    key = hashlib.sha256(
        "\0".join([src, arch, f"{ver[0]}.{ver[1]}", " ".join(_OPTIONS)]).encode()
    ).hexdigest()[:16]
    d = cache_dir()
    path = d / f"{Path(source_file).stem}-{arch}-{key}.cubin"
    if path.is_file() and not force:
        return Built(source_file, arch, path, True)
    cubin = compile_cubin(src, source_file, arch)
    d.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-", suffix=".cubin")
    with os.fdopen(fd, "wb") as f:
        f.write(cubin)
    os.replace(tmp, path)
    return Built(source_file, arch, path, False)


def build_all(archs=DEFAULT_ARCHS, *, force: bool = False) -> list[Built]:
    """Build every source for every arch (``python -m eaas.runtime.cuda.nvrtc`` does this)."""
    jobs = [(s, a) for s in SOURCES for a in archs]
    return [build(s, a, force=force) for s, a in tqdm(jobs, desc="nvrtc", unit="cubin")]


def device_arch(device_index: int = 0) -> str:
    """``sm_XY`` of a CUDA device (torch's view). Raises GpuUnavailableError without a GPU."""
    if not torch.cuda.is_available():
        raise GpuUnavailableError("no CUDA device visible to torch")
    major, minor = torch.cuda.get_device_capability(device_index)
    return f"sm_{major}{minor}"


def _drv_check(res, what: str):
    """Unwrap a ``cuda.bindings.driver`` result tuple; raise RuntimeError on a CUDA error."""
    err, *rest = res if isinstance(res, tuple) else (res,)
    if int(err) != 0:
        from cuda.bindings import driver  # optional (cuda-python): only where a GPU runs

        _, s = driver.cuGetErrorString(err)
        raise RuntimeError(f"{what}: CUDA error {int(err)} {s.decode() if s else ''}")
    return rest[0] if len(rest) == 1 else tuple(rest)


class Module:
    """A loaded cubin on one CUDA device (the current torch context) with a launch helper.

    Use :func:`load_module`; kernels launch on torch's current stream by default, so they order
    with torch work and are captured by ``torch.cuda.graph``.
    """

    def __init__(self, source_file: str, device_index: int):
        from cuda.bindings import driver  # optional (cuda-python): only where a GPU runs

        self._driver = driver
        self.source_file = source_file
        self.device_index = device_index
        self.arch = device_arch(device_index)
        self.built = build(source_file, self.arch)
        _drv_check(driver.cuInit(0), "cuInit")
        self._module = _drv_check(
            driver.cuModuleLoadData(self.built.path.read_bytes()), f"cuModuleLoadData {source_file}"
        )
        self._fns: dict[str, object] = {}

    def function(self, name: str):
        """The ``CUfunction`` of kernel ``name`` (``extern "C"`` name)."""
        fn = self._fns.get(name)
        if fn is None:
            fn = _drv_check(
                self._driver.cuModuleGetFunction(self._module, name.encode()),
                f"kernel {name} in {self.source_file}",
            )
            self._fns[name] = fn
        return fn

    def launch(self, name: str, grid, block, args, *, shmem: int = 0, stream=None) -> None:
        """Launch kernel ``name``.

        Args:
            grid, block: 1 to 3 ints each.
            args: the kernel's parameters in order: a ``torch.Tensor`` passes its data pointer,
                a ``ctypes`` scalar passes as that type, a plain ``int`` as C ``int``.
            stream: a ``torch.cuda.Stream`` (default: torch's current stream).
        """
        g = tuple(grid) + (1,) * (3 - len(tuple(grid)))
        b = tuple(block) + (1,) * (3 - len(tuple(block)))
        vals: list[int | None] = []  # kernel parameter values
        types: list[type[ctypes._SimpleCData[Any]]] = []  # their C types
        for a in args:
            if isinstance(a, torch.Tensor):
                vals.append(a.data_ptr())
                types.append(ctypes.c_void_p)
            elif isinstance(a, ctypes._SimpleCData):
                vals.append(a.value)
                types.append(type(a))
            elif isinstance(a, int):
                vals.append(a)
                types.append(ctypes.c_int)
            else:
                raise TypeError(f"kernel {name}: unsupported argument {a!r}")
        s = stream if stream is not None else torch.cuda.current_stream(self.device_index)
        _drv_check(
            self._driver.cuLaunchKernel(
                self.function(name),
                *g,
                *b,
                shmem,
                self._driver.CUstream(s.cuda_stream),
                (tuple(vals), tuple(types)),
                0,
            ),
            f"launch {name}",
        )


_MODULES: dict[tuple[str, int], Module] = {}


def load_module(source_file: str, device=None) -> Module:
    """Load (building if needed) ``native/<source_file>`` on a CUDA device, once per process.

    Raises:
        GpuUnavailableError: no CUDA device / no cuda-python here.
        NvrtcError: the source does not compile for the device's arch.
    """
    if not torch.cuda.is_available():
        raise GpuUnavailableError("no CUDA device visible to torch")
    try:
        # optional dependency (cuda-python), checked here to raise GpuUnavailableError
        import cuda.bindings.driver  # noqa: F401
    except ImportError as e:
        raise GpuUnavailableError(f"cuda-python is not installed ({e})") from None
    idx = torch.device(device).index if device is not None else None
    idx = torch.cuda.current_device() if idx is None else idx
    key = (source_file, idx)
    if key not in _MODULES:
        with torch.cuda.device(idx):
            torch.cuda.init()
            torch.empty(1, device=f"cuda:{idx}")  # the primary context is current from here
            _MODULES[key] = Module(source_file, idx)
    return _MODULES[key]


if __name__ == "__main__":  # pragma: no cover - `python -m eaas.runtime.cuda.nvrtc [ARCH...]`
    for b in build_all(tuple(sys.argv[1:]) or DEFAULT_ARCHS, force=True):
        print(f"{b.source:18s} {b.arch:7s} {b.path.stat().st_size:8d} B  {b.path}")
