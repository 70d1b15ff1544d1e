# SHIM(issue17): moved to eaas.runtime.cuda.device; remove at merge
from eaas.runtime.cuda.device import (  # noqa: F401
    CPU_SERVER_CUDA_PAYLOAD,
    check_listen_device,
    check_world_device,
)
