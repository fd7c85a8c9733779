"""RL on a LoRA adapter (`training.adapter: lora`): the parent's weights stay frozen and only the adapter's
low-rank updates train. An engine serves the adapter itself (vLLM hot-loads it) or the merged weights, which
every checkpoint holds as a plain Hugging Face model, the adapter saved beside it in `adapter/`.
"""

from __future__ import annotations

import copy

import torch

from lightning_dagster.gateway.options import LoraSpec

ADAPTER_DIR = "adapter"  # the adapter folder inside a checkpoint trained with LoRA


def wrap(model: torch.nn.Module, spec: LoraSpec) -> torch.nn.Module:
    """`model` with a fresh adapter on `spec.targets` (B = 0: it starts as exactly the parent). ValueError
    naming the targets when the model has none of them."""
    from peft import LoraConfig, get_peft_model

    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    if not set(spec.targets) & names:
        raise ValueError(
            f"lora_targets {list(spec.targets)} name no module of this model (its linear layers include "
            f"{sorted(n for n in names if n.endswith('proj'))[:8]})"
        )
    config = LoraConfig(
        r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.targets), lora_dropout=0.0, bias="none"
    )
    wrapped = get_peft_model(model, config)
    wrapped.eval()  # no dropout anywhere: the ratio to the behaviour policy starts at exactly 1
    return wrapped


def is_wrapped(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config")


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's weights under peft's names (`...q_proj.lora_A.weight`), as an adapter file holds them."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


def load_adapter_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    from peft import set_peft_model_state_dict

    set_peft_model_state_dict(model, state)


def merged(model: torch.nn.Module) -> torch.nn.Module:
    """A plain copy of the model with the adapter's update added into its weights."""
    return copy.deepcopy(model).merge_and_unload()
