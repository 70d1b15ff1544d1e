"""The remote routed-experts layer: vLLM's ``RoutedExperts`` without weights, whose
``FusedMoEMethodBase.apply`` sends the tokens to EaaS expert servers.

Where it sits in vLLM (0.32): a model's MoE block builds its ``FusedMoE`` with
``FusedMoEFactory``, which creates a ``MoERunner`` (router, shared experts, the ``moe_forward``
custom op entry) and a ``RoutedExperts`` (the expert weights and their quantization method).
``RoutedExperts`` is a ``PluggableLayer``; :func:`install` registers
:class:`RemoteRoutedExperts` as its out-of-tree replacement (``PluggableLayer.register_oot``), so
every ``RoutedExperts`` vLLM instantiates is one of these. The runner is unchanged: inside its
``moe_forward`` op it runs the shared experts (DeepSeek-V3's stay local), the router
(``select_experts``: vLLM's top-k ids and weights, grouped top-k and score-correction bias
included) and then ``RoutedExperts.forward_modular`` -> :meth:`RemoteExpertsMethod.apply`,
which returns the routed output ``[T, H]``.

Weights: :meth:`RemoteExpertsMethod.create_weights` registers the parameters vLLM's loaders look
up (``w13_weight``, ``w2_weight``) as empty tensors (0 bytes), and
:meth:`RemoteRoutedExperts.weight_loader` accepts every routed-expert checkpoint tensor without
copying it: the process never holds routed-expert weights.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch
from vllm.config import get_current_vllm_config
from vllm.model_executor.custom_op import PluggableLayer, op_registry_oot
from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.utils import set_weight_attrs

from eaas.vllm.client import ExpertClient
from eaas.vllm.scheduler import fails_requests

log = logging.getLogger("eaas.vllm")

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_index(layer_name: str) -> int:
    """The model layer index in a vLLM layer prefix (``model.layers.3.mlp.experts`` -> 3).

    Raises:
        ValueError: no ``layers.<n>.`` in the name.
    """
    m = _LAYER.search(layer_name + ".")
    if m is None:
        raise ValueError(f"eaas.vllm: no layer index in the MoE layer name {layer_name!r}")
    return int(m.group(1))


@torch.library.custom_op("eaas::remote_routed_experts", mutates_args=())
def remote_routed_experts(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, layer: int
) -> torch.Tensor:
    """The routed experts of MoE layer ``layer`` on the expert servers, as one torch custom op
    (``torch.ops.eaas.remote_routed_experts``): ``x`` ``[T, H]``, ``topk_ids`` / ``topk_weights``
    ``[T, k]`` -> a new ``[T, H]`` tensor in ``x.dtype``.

    An opaque op, so ``torch.compile`` never traces the dispatcher's host I/O: vLLM's CPU
    build calls the MoE layer's body directly inside the compiled model (no ``moe_forward``
    custom op there), and dynamo would otherwise trace into it and fail. Its fake (meta)
    implementation gives the shape for tracing.

    Raises:
        RuntimeError: no :class:`~eaas.vllm.client.ExpertClient` in this process.
        NoLiveReplica: as :meth:`~eaas.vllm.client.ExpertClient.run`.
    """
    client = ExpertClient.current()
    return client.run(layer, x, topk_ids, topk_weights)


@remote_routed_experts.register_fake
def _remote_routed_experts_fake(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, layer: int
) -> torch.Tensor:
    return torch.empty_like(x)


class RemoteExpertsMethod(FusedMoEMethodBase):
    """The ``FusedMoEMethodBase`` of a remote layer: no weights; ``apply`` dispatches.

    Args:
        moe: the layer's ``FusedMoEConfig`` (hidden size, activation dtype, expert count).
        layer: the model layer index (the routing table's layer).
        client: the process's :class:`~eaas.vllm.client.ExpertClient`.
    """

    def __init__(self, moe: FusedMoEConfig, layer: int, client: ExpertClient):
        super().__init__(moe)
        self.layer = layer
        self.client = client

    def create_weights(
        self,
        layer: torch.nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        # the names vLLM's loaders look up (DeepSeek's indexes named_parameters()); 0 bytes each
        for name in ("w13_weight", "w2_weight"):
            p = torch.nn.Parameter(torch.empty(0, dtype=params_dtype), requires_grad=False)
            layer.register_parameter(name, p)
            set_weight_attrs(p, extra_weight_attrs)

    def maybe_roundup_sizes(self, hidden_size, intermediate_size_per_partition, act_dtype, cfg):
        return hidden_size, intermediate_size_per_partition  # no kernel: no padding

    def get_fused_moe_quant_config(self, layer: torch.nn.Module) -> None:
        return None

    def apply(
        self,
        layer: Any,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared_experts: Any,
        shared_experts_input: torch.Tensor | None,
    ) -> torch.Tensor:
        """``x`` ``[T, H]``, ``topk_ids`` / ``topk_weights`` ``[T, k]`` (vLLM's router output)
        -> ``[T, H]`` = ``sum_j w[t, j] E_{ids[t, j]}(x[t])`` from the expert servers.

        Raises:
            NoLiveReplicaError: a selected expert has no live replica (after failover).
        """
        return torch.ops.eaas.remote_routed_experts(x, topk_ids, topk_weights, self.layer)


class RemoteRoutedExperts(RoutedExperts):
    """vLLM's ``RoutedExperts`` with its experts on EaaS expert servers (see the module doc).

    Raises (at construction):
        NotImplementedError: a quantized checkpoint, expert parallelism or EPLB (their weight
            layouts and expert maps are vLLM's own; the expert servers serve the
            checkpoint's unquantized experts), or a parallel MoE (tp / dp / pcp > 1).
    """

    def _get_quant_method(
        self,
        prefix: str,
        quant_config: QuantizationConfig | None,
        moe_config: FusedMoEConfig,
    ) -> FusedMoEMethodBase:
        if quant_config is not None:
            raise NotImplementedError(
                f"eaas.vllm: {prefix}: quantized checkpoints ({quant_config.get_name()}) are not "
                "supported; the expert servers serve the unquantized experts"
            )
        par = moe_config.moe_parallel_config
        if (
            par.use_ep
            or par.enable_eplb
            or moe_config.num_experts != moe_config.num_logical_experts
        ):
            raise NotImplementedError(
                f"eaas.vllm: {prefix}: expert parallelism / EPLB / redundant experts are vLLM's "
                "own expert placement; with EaaS the expert servers hold the experts"
            )
        if par.tp_size > 1 or par.dp_size > 1 or par.pcp_size > 1:
            # each rank would dispatch the whole layer and vLLM would all-reduce the copies
            raise NotImplementedError(
                f"eaas.vllm: {prefix}: tensor / data / context parallel MoE (tp {par.tp_size}, "
                f"dp {par.dp_size}, pcp {par.pcp_size}) is not supported; run one rank per "
                "vLLM process (scale with more attention pods instead)"
            )
        layer = layer_index(prefix)
        client = ExpertClient.get(
            hidden_size=moe_config.hidden_dim,
            dtype=moe_config.in_dtype,
            num_experts=moe_config.num_logical_experts,
        )
        client.add_layer(layer)
        # end only the affected requests when vLLM's scheduler is ours (eaas.vllm.scheduler)
        client.fail_requests = fails_requests(
            get_current_vllm_config().scheduler_config.scheduler_cls
        )
        self.eaas_skipped_bytes = 0  # this layer's routed-expert checkpoint bytes not loaded
        return RemoteExpertsMethod(moe_config, layer, client)

    def weight_loader(
        self,
        param: torch.nn.Parameter,
        loaded_weight: torch.Tensor,
        weight_name: str,
        shard_id: str,
        expert_id: int,
        return_success: bool = False,
    ) -> bool | None:
        """Accept a routed expert's checkpoint tensor without keeping it (the expert servers
        load their own copies)."""
        nbytes = loaded_weight.numel() * loaded_weight.element_size()
        self.eaas_skipped_bytes += nbytes
        method = self.quant_method
        if isinstance(method, RemoteExpertsMethod):
            method.client.skipped_bytes += nbytes
        return True if return_success else None


def install() -> None:
    """Register :class:`RemoteRoutedExperts` for vLLM's ``RoutedExperts`` (idempotent).

    Raises:
        RuntimeError: this vLLM has no ``RoutedExperts`` pluggable layer (an unsupported version).
    """
    name = RoutedExperts.__name__
    if op_registry_oot.get(name) is RemoteRoutedExperts:
        return
    if getattr(RoutedExperts, "name", None) != "routed_experts":
        raise RuntimeError(
            "eaas.vllm: this vLLM has no 'routed_experts' pluggable layer; supported: vLLM 0.32"
        )
    PluggableLayer.register_oot(RemoteRoutedExperts, name=name)
    log.info("eaas.vllm: routed experts run on EaaS expert servers")
