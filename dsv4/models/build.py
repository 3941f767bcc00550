"""Build a model from its config and fill it from a checkpoint, without a throwaway random init."""

from __future__ import annotations

import torch

from dsv4.models.config import ModelConfig
from dsv4.models.deepseek_v4 import DeepseekV4ForCausalLM
from dsv4.models.layers.rope import RotaryTable
from dsv4.models.loader import load_into_module, param_dtype


def build_model(cfg: ModelConfig, model_dir: str | None, dtype: torch.dtype, device: torch.device | str
                ) -> DeepseekV4ForCausalLM:
    """Create the module on the meta device, materialize every tensor in its load dtype on `device` (norms,
    mHC, sinks and router biases stay fp32), then load the checkpoint (all tensors must be present)."""
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(cfg)
    model = model.to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.data = p.data.to(param_dtype(name, dtype))
        for module in model.modules():
            if isinstance(module, RotaryTable):
                module.reset()
    if model_dir is not None:
        load_into_module(model, model_dir)
    return model.eval()
