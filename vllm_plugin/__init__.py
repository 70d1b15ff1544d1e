"""``eaas.vllm``: a vLLM general plugin that runs the routed experts of every MoE layer of a
vLLM model on EaaS expert servers.

vLLM calls :func:`register` (entry point ``eaas`` of the group ``vllm.general_plugins``) in each
of its processes. Unless a routing-table source is configured (``EAAS_ROUTING_TABLE`` or
``EAAS_ROUTING_TABLE_CONFIGMAP``, :class:`~eaas.runtime.options.vllm.VllmPluginOptions`) it does
nothing. Otherwise it registers :class:`~eaas.vllm.experts.RemoteRoutedExperts` as the
out-of-tree replacement of vLLM's ``RoutedExperts`` pluggable layer (vLLM's documented
``PluggableLayer.register_oot``): every ``FusedMoE`` layer vLLM builds then holds no routed-expert
weights and runs its routed experts through the runtime's dispatcher, with vLLM's own router
output (top-k ids and weights) as input; shared experts, attention, sampling and the scheduler
stay vLLM's. docs/vllm.md describes the supported vLLM versions and what the plugin touches.

Modules: :mod:`.experts` (the layer and its ``FusedMoEMethodBase``), :mod:`.client` (the
worker process's dispatcher, routing-table watches, failure reports), :mod:`.http` (the
plugin's own port: push endpoint, ``/health``, ``/metrics``), :mod:`.scheduler` (vLLM's
scheduler ending only the requests a missing expert affects), :mod:`.failed` and
:mod:`.middleware` (those requests' HTTP 503). Only this module and :mod:`.failed` are imported
when the plugin is disabled (no torch, no vLLM import).
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil

from eaas.runtime.options.vllm import ENV, VllmPluginOptions
from eaas.vllm.failed import default_dir

log = logging.getLogger("eaas.vllm")

#: vLLM versions this plugin was built and tested against (``vllm.__version__`` prefixes)
SUPPORTED_VLLM = ("0.32.",)


def register() -> None:
    """vLLM's entry point: register the remote routed-experts layer when enabled.

    Safe to call more than once (vLLM may load plugins several times in one process).

    Raises:
        ValueError: a bad ``EAAS_*`` variable (the message names it): vLLM logs it and the
            process fails to start rather than serving without the experts it was told to use.
        RuntimeError: a vLLM version without the extension point this plugin uses.
    """
    options = VllmPluginOptions.from_env(os.environ)
    if not options.enabled:
        return
    # vLLM counts NaNs per request in the logits: the channel by which the worker's layers tell
    # eaas.vllm.scheduler which requests lost an expert (a no-op with another scheduler)
    os.environ.setdefault("VLLM_COMPUTE_NANS_IN_LOGITS", "1")
    # where the scheduler records the requests it ends and the API server's middleware reads
    # them (eaas.vllm.failed): set in vLLM's first process, before it starts the engine core,
    # so every process of this vLLM inherits the same one
    if not os.environ.get(ENV["failed_requests_dir"]):
        record = default_dir()
        os.environ[ENV["failed_requests_dir"]] = str(record)
        atexit.register(shutil.rmtree, record, ignore_errors=True)  # this vLLM's first process
    from eaas.vllm.experts import install  # lazy: torch and vLLM only when enabled

    install()
