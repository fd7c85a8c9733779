"""The gateway's options as one frozen object (the user's serving settings and the gateway's own), passed
whole to the app and to a gateway child. Every field is a `gateway serve` flag; secrets are never options."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from lightning_dagster.settings import (
    ServingSettings,
    Settings,
    TrainingSettings,
    add_flags,
    flag_of,
    from_flags,
)

# What the gateway reads of the user's serving settings (the rest is the runner's, or the secret).
SERVING_FIELDS = (
    "engine", "vllm_url", "vllm_args", "vllm_dtype", "vllm_enforce_eager", "upstream_url", "engine_threads",
    "engine_device", "max_batch", "engine_process", "host", "port",
)  # fmt: skip


@dataclass(frozen=True)
class LoraSpec:
    """One LoRA adapter's shape (`training.adapter: lora`): `rank`, `alpha` (the update is scaled by
    alpha / rank) and the module names (`targets`, e.g. q_proj) that get one."""

    rank: int
    alpha: float
    targets: tuple[str, ...]


class GatewayOptions(Settings):
    """How a gateway serves. `serving`: the user's settings it reads (`SERVING_FIELDS` of
    `settings.ServingSettings`; never the secret); the others are the gateway's own."""

    serving: ServingSettings = Field(
        default_factory=ServingSettings, description="the user's serving settings"
    )
    upstream_model: str = Field("", description="the model name sent upstream; empty: the upstream's own")
    model_names: list[str] = Field(
        default_factory=list,
        description="restricts the model names served (repeatable; a project's harness.model_names): "
        "empty, any name the agent sends is served the policy; else only these and the model's own, any "
        "other is a 404 model_not_found",
    )
    max_body_bytes: int = Field(4 << 20, ge=1, description="the largest request body taken (413 beyond)")
    write_behind_ms: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="acknowledge LLM calls before their span commits, batching spans for up to this long (a "
        "crash loses at most that window); 0: every response follows its span's commit",
    )
    fsync_spans: bool = Field(
        False,
        description="flush each LLM span to disk before answering (else with the attempt's next reward)",
    )
    model_roots: list[Path] = Field(
        default_factory=list,
        description="a directory POST /admin/weights may read (repeatable); none: the models directory",
    )
    state_ttl_s: float = Field(
        0.5,
        ge=0,
        allow_inf_nan=False,
        description="how long an attempt's running state is trusted before it is read again (a finished "
        "attempt is refused at most this long after it ends)",
    )
    max_contexts: int = Field(10_000, ge=1, description="attempts whose context the gateway keeps in memory")
    weight_sync: bool | None = Field(
        None,
        description="follow the policy versions published in the store and report what this gateway serves; "
        "empty: when the store is shared (PostgreSQL) and the gateway loads weights",
    )
    weight_sync_poll_s: float = Field(
        0.5, gt=0, allow_inf_nan=False, description="how often the weight sync reads the published version"
    )
    weights_wait_s: float = Field(
        30.0,
        gt=0,
        allow_inf_nan=False,
        description="how long a call waits for a weight swap, or for its rollout's policy version, before a 503",
    )
    lora: LoraSpec | None = Field(
        None,
        description="engine vllm: the shape of the LoRA adapters the trainer pushes (the server is started able "
        "to serve them; `gateway serve`: the training settings' --adapter lora and --lora-*); none: pushes "
        "are whole weights",
    )
    agl_train_temperature: float = Field(
        1.0, gt=0, allow_inf_nan=False, description="sampling temperature of Agent Lightning train rollouts"
    )
    agl_val_temperature: float = Field(
        1.0, gt=0, allow_inf_nan=False, description="sampling temperature of its val rollouts"
    )

    @model_validator(mode="after")
    def _no_secret(self) -> GatewayOptions:
        if self.serving.secret:
            raise ValueError("serving.secret: a secret is not an option; it travels in GatewayKeys")
        return self

    def with_serving(self, **changes: Any) -> GatewayOptions:
        """A copy with these serving settings changed (each validated)."""
        return self.updated({"serving": self.serving.updated(changes)})


# `lora` is the training settings' (`gateway serve` generates its flags from them: `add_option_flags`)
OWN_FIELDS = tuple(name for name in GatewayOptions.model_fields if name not in ("serving", "lora"))
ADAPTER_FIELDS = ["adapter", "lora_rank", "lora_alpha", "lora_targets"]


def serving_settings(serving: ServingSettings, **changes: Any) -> ServingSettings:
    """Plain `ServingSettings` of any (a Dagster resource included), with `changes` applied (validated)."""
    return ServingSettings.parse(
        {name: getattr(serving, name) for name in ServingSettings.model_fields} | changes
    )


def gateway_options(serving: ServingSettings | None = None, **own: Any) -> GatewayOptions:
    """The one conversion of the user's serving settings to gateway options: what the gateway reads of them
    (`SERVING_FIELDS`; not the runner's settings nor the secret, which travels in `GatewayKeys`), and the
    gateway's own options from `own` (validated; `SettingsError` names a bad one)."""
    given = serving if serving is not None else ServingSettings()
    read = ServingSettings.parse({name: getattr(given, name) for name in SERVING_FIELDS})
    return GatewayOptions.parse({"serving": read, **own})


def add_option_flags(parser: argparse.ArgumentParser, source: Any) -> None:
    """`gateway serve`'s option flags: the serving settings the gateway reads (`--upstream-url` into the
    `source` group, where it excludes `--model`) and every option of its own."""
    add_flags(source, ServingSettings, ["upstream_url"])
    add_flags(parser, ServingSettings, [n for n in SERVING_FIELDS if n != "upstream_url"])
    add_flags(parser, GatewayOptions, list(OWN_FIELDS))
    add_flags(parser, TrainingSettings, ADAPTER_FIELDS)


def options_from_flags(args: argparse.Namespace, base: GatewayOptions | None = None) -> GatewayOptions:
    """`base` (default: the defaults) with the flags given applied; `SettingsError` names a bad flag."""
    base = base or GatewayOptions()
    serving = from_flags(base.serving, args, command="gateway serve")
    t = from_flags(TrainingSettings(), args, command="gateway serve")
    lora = LoraSpec(t.lora_rank, t.lora_alpha, tuple(t.lora_targets)) if t.adapter == "lora" else base.lora
    return from_flags(base.updated({"serving": serving, "lora": lora}), args, command="gateway serve")


def flags_given(args: argparse.Namespace) -> list[str]:
    """The option flags given on the command line (`add_flags` leaves the others unset)."""
    return [flag_of(name) for name in (*SERVING_FIELDS, *OWN_FIELDS, *ADAPTER_FIELDS) if hasattr(args, name)]
