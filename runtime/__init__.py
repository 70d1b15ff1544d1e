"""EaaS serving runtime: attention clients, expert servers, transports, routing table.

Nothing here imports torch at package import time; modules that need it import it themselves,
so the operator (which uses only :mod:`eaas.runtime.placement` and :mod:`eaas.runtime.tables`)
stays light.
"""
