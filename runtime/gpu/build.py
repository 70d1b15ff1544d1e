# SHIM(issue17): moved to eaas.runtime.cuda.nvrtc; remove at merge
from eaas.runtime.cuda.nvrtc import (  # noqa: F401
    DEFAULT_ARCHS,
    SOURCES,
    Built,
    Module,
    NvrtcError,
    build,
    build_all,
    cache_dir,
    compile_cubin,
    device_arch,
    load_module,
    native_dir,
    nvrtc,
    nvrtc_version,
    supported_archs,
)
