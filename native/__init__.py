"""CUDA C++ sources of the EaaS GPU data plane (package data; compiled by NVRTC at first use).

See ``native/README.md`` and :mod:`eaas.runtime.gpu.build`.
"""
