"""Model adapters: Hugging Face MoE architectures, tiny default model, expert weight loading.

Public API (see each module's docstring for shapes, dtypes and errors):

- :func:`read_model_info` / :class:`ModelInfo` (``arch``): what a checkpoint's ``config.json`` says.
- :func:`load_expert_weights` (``weights``): read only the hosted ``(layer, expert)`` tensors.
- :func:`load_attention_model` (``attention``): the model with routed experts swapped for
  ``experts_factory(layer, info)`` modules (the seam expert servers plug into).
- :func:`write_tiny_model` / :func:`default_model_dir` (``tiny``): the generated tiny DeepSeek-V3.
- :func:`reference_generate` / :func:`reference_logits` (``reference``): ground truth for tests.
"""

from eaas.runtime.models.arch import ModelInfo, read_model_info
from eaas.runtime.models.attention import LocalExperts, load_attention_model, local_experts_factory
from eaas.runtime.models.reference import reference_generate, reference_logits
from eaas.runtime.models.tiny import default_model_dir, write_tiny_model
from eaas.runtime.models.weights import group_by_layer, load_expert_weights

__all__ = [
    "ModelInfo",
    "read_model_info",
    "load_expert_weights",
    "group_by_layer",
    "load_attention_model",
    "LocalExperts",
    "local_experts_factory",
    "write_tiny_model",
    "default_model_dir",
    "reference_generate",
    "reference_logits",
]
