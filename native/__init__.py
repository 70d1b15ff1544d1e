"""CUDA C++ sources of the EaaS GPU data plane (package data; compiled by NVRTC at first use).

See ``native/README.md`` and :mod:`eaas.runtime.cuda.nvrtc`; :mod:`eaas.native.device_check`
is the one-GPU check's table (run by ``native/device_check.sh``).
"""
