# SHIM(issue17): moved to eaas.runtime.cuda; remove at merge
from eaas.runtime.cuda import GpuUnavailableError, cuda_available  # noqa: F401
