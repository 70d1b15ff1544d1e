"""AttentionFleet with ``spec.engine: vllm`` (pure): the client container runs ``vllm serve``
with the eaas.vllm plugin instead of ``eaas attention-client``.

The plugin is configured by environment variables
(:class:`~eaas.runtime.options.vllm.VllmPluginOptions`, the one source of their names): it
watches the pool's routing-table ConfigMap, accepts pushes with the fleet's token and answers
``/health`` / ``/routing-table`` / ``/metrics`` on :func:`push_port` (the API port + 1), reports
failed expert servers to the operator, and uses the pool's dispatch deadline. vLLM serves the
OpenAI API on ``spec.port``; readiness is vLLM's ``/health``. ``vllm serve`` runs with
``--dtype float32`` (the pool's servers' dtype) and the plugin's scheduler and middleware
(:func:`~eaas.runtime.options.vllm.plugin_vllm_args`), so a request that needs an expert
without a live replica ends with a 503 and the others go on; ``spec.vllm.args`` follow (never
a flag the operator sets: :data:`~eaas.operator.crd.VLLM_OWNED_FLAGS`).

``vllm`` is found through the container's ``PATH`` (the image's; on the testbed's process nodes,
which have no images, a ``PATH`` in the pod template overlay's ``env`` names the vLLM venv's
``bin``: docs/vllm.md).
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

from eaas.operator.crd import AttentionFleetSpec, ExpertPoolSpec, owned_vllm_flag
from eaas.operator.names import PUSH_TOKEN_KEY, PUSH_TOKEN_MOUNT_DIR, table_configmap_name
from eaas.operator.overlay import OverlayError
from eaas.runtime.options.vllm import VllmPluginOptions, plugin_vllm_args


def push_port(spec: AttentionFleetSpec) -> int:
    """The port the operator pushes routing tables to: the API port (eaas), the plugin's port,
    ``spec.port + 1`` (vllm)."""
    return spec.port + 1 if spec.engine == "vllm" else spec.port


def vllm_container(
    spec: AttentionFleetSpec,
    pool: ExpertPoolSpec | None,
    *,
    namespace: str,
    client_id: str,
    failure_report_url: str | None,
) -> tuple[list[str], list[dict[str, Any]], list[dict[str, Any]]]:
    """``(command, env entries, extra container ports)`` of a vLLM client container.

    Args:
        client_id: the plugin's client id (``$(EAAS_POD_NAME)``: the kubelet expands it from the
            pod-name variable defined before these entries).

    Raises:
        OverlayError: ``engine: vllm`` with ``port`` 65535 (no room for the plugin's port), with
            a pool on the nvshmem transport, or a ``spec.vllm.args`` item that sets a flag the
            operator sets (status InvalidSpec).
    """
    if spec.port >= 65535:
        raise OverlayError("spec.port: engine vllm needs port + 1 for the plugin; use < 65535")
    if pool is not None and pool.transport.scheme == "nvshmem":
        raise OverlayError("spec.engine: vllm does not join a pool's nvshmem world")
    model = spec.model.model_path()
    plugin = VllmPluginOptions(
        routing_table_configmap=f"{namespace}/{table_configmap_name(spec.expert_pool_ref.name)}",
        push_token_file=f"{PUSH_TOKEN_MOUNT_DIR}/{PUSH_TOKEN_KEY}",
        http_port=push_port(spec),
        http_host="0.0.0.0",
        failure_report_url=failure_report_url or None,
        client_id=client_id,
        dispatch_timeout=(
            pool.failure_detection.dispatch_timeout_ms / 1000 if pool is not None else 5.0
        ),
    )
    command = ["vllm", "serve", model, "--served-model-name", PurePosixPath(model).name]
    # the pool's expert servers compute in float32 (ExpertPool has no dtype): vLLM's "auto" would
    # downcast a float32 checkpoint and send bf16 hidden states to them
    command += ["--dtype", "float32"]
    command += ["--host", "0.0.0.0", "--port", str(spec.port), *plugin_vllm_args()]
    extra = spec.vllm.args if spec.vllm is not None else []
    for arg in extra:  # the CRD's rule refuses these at admission; a CRD without it lands here
        if (flag := owned_vllm_flag(arg)) is not None:
            raise OverlayError(f"spec.vllm.args: {arg!r} sets {flag}, which the operator sets")
    command += extra
    env = [{"name": k, "value": v} for k, v in sorted(plugin.env().items())]
    env.append({"name": "VLLM_NO_USAGE_STATS", "value": "1"})
    ports = [{"name": "eaas", "containerPort": push_port(spec), "protocol": "TCP"}]
    return command, env, ports
