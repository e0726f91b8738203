"""Which parameters train, and the plain full weights the engine loads whatever trained.

    freeze_below_top(model, k)                 # only the top k transformer layers and the final norm train
    add_lora(model, rank, alpha, targets)      # peft LoRA adapters; every base weight frozen
    full_state_dict(model)                     # plain HF keys, LoRA merged: what save_weights writes

Freezing is what makes these options fast, not only small: with the input embedding frozen, autograd
records nothing below the first trainable layer (no backward through the frozen bottom of the model),
the tied LM head gets no 49k × H weight gradient, and the optimizer holds only what trains (the loop
builds AdamW from `requires_grad` parameters alone).

LoRA is injected in place (`peft.inject_adapter_in_model`), so the model keeps its Hugging Face class and
`stepline.trainer.tree_forward` reads it exactly like a fully trained one. The engine loads a plain HF directory
(`update_weights_from_disk`), so every push merges: W = W0 + (alpha / r) · B A per adapted projection,
computed into a new dict, never into the training model (merging in place and back would drift W0).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["add_lora", "freeze_below_top", "full_state_dict", "has_lora", "linear_names", "transformer_layers"]

LORA_ADAPTER = "default"  # peft's adapter name; one adapter per model here


def transformer_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a Llama/Qwen-style causal LM (`model.model.layers`), bottom first."""
    layers = getattr(model.base_model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__}: no decoder layers at model.base_model.layers")
    return layers


def freeze_below_top(model: nn.Module, k: int) -> None:
    """Train only the top k decoder layers and the final norm; the embedding, the LM head (tied or not)
    and every lower layer are frozen. Their weights stay bit-identical across updates."""
    layers = transformer_layers(model)
    if not 1 <= k <= len(layers):
        raise ValueError(f"train_layers must be in 1..{len(layers)}, got {k}")
    model.requires_grad_(False)
    for layer in layers[len(layers) - k:]:
        layer.requires_grad_(True)
    norm = getattr(model.base_model, "norm", None)
    if norm is not None:
        norm.requires_grad_(True)


def linear_names(model: nn.Module) -> set[str]:
    """Short names (the last dotted part) of the nn.Linear modules inside the decoder layers: the names
    `lora_targets` may use."""
    return {name.rsplit(".", 1)[-1] for name, module in transformer_layers(model).named_modules()
            if isinstance(module, nn.Linear)}


def add_lora(model: nn.Module, rank: int, alpha: float, targets: list[str], top_layers: int | None = None) -> nn.Module:
    """Freeze the whole model and inject LoRA adapters (dropout 0, so the training forward equals the
    engine's; B = 0 at start, so the model starts as the base exactly) into the named projections of every
    layer, or of the top `top_layers` only. Returns the same model object."""
    from peft import LoraConfig, inject_adapter_in_model

    unknown = sorted(set(targets) - linear_names(model))
    if unknown:
        raise ValueError(f"lora_targets {unknown} are not linear layers of the model; known: {sorted(linear_names(model))}")
    n = len(transformer_layers(model))
    layers = list(range(n - top_layers, n)) if top_layers is not None else None
    model.requires_grad_(False)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, bias="none",
                        layers_to_transform=layers, layers_pattern="layers" if layers is not None else None)
    inject_adapter_in_model(config, model, adapter_name=LORA_ADAPTER)
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)
    return model


def has_lora(model: nn.Module) -> bool:
    from peft.tuners.lora import LoraLayer

    return any(isinstance(m, LoraLayer) for m in model.modules())


@torch.no_grad()
def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights under plain Hugging Face names, each adapted projection merged (W0 + ΔW).
    Without LoRA this is `model.state_dict()` itself."""
    from peft.tuners.lora import LoraLayer

    state = model.state_dict()
    if not has_lora(model):
        return state
    merged = {f"{name}.base_layer.weight": m.base_layer.weight + m.get_delta_weight(LORA_ADAPTER).to(m.base_layer.weight.dtype)
              for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if ".lora_" in key:
            continue
        out[key.replace(".base_layer.", ".")] = merged.get(key, value)
    return out
