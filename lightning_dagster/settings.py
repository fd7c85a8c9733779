"""Every setting a user can set, defined once: its name, type, default, bounds and help, one class per
concern. The Dagster resources (`orchestration.resources`), the CLI flags (`add_flags`) and the project
file's `training:` / `serving:` / `gate:` sections are all generated from these classes, so a setting has
one name and one default wherever it is set (`tests/test_settings.py` holds every surface to that).

Precedence, lowest first: these defaults, the project file's sections, then the surface's own (a CLI flag
given on the command line, a Dagster resource field set in code or by an environment variable).
"""

from __future__ import annotations

import argparse
import os
import types
import typing
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

S = TypeVar("S", bound="Settings")
# A string for which "" means nothing (a name, a flag, a role): refused, naming its field. A setting whose ""
# means "unset" says so in its description and stays a plain `str`.
NonEmpty = Annotated[str, Field(min_length=1)]


def at_least(low: int, default: int, description: str) -> Any:
    """An integer setting: at least `low`, `default` when not set."""
    return Field(default, ge=low, description=description)


def unset(description: str) -> Any:
    """A string setting whose "" means unset (its description says what then)."""
    return Field("", description=description)


def finite(default: float | None, description: str, **bounds: float) -> Any:
    """A number setting that refuses NaN and infinities."""
    return Field(default, **bounds, allow_inf_nan=False, description=description)


class UsageError(Exception):
    """What the user gave (a flag, a setting, a file) cannot be used: the command says why and exits 2."""


class SettingsError(ValueError, UsageError):
    """A setting given a value it does not take; the message names the setting and the flag or key."""


class Settings(BaseModel):
    """One concern's settings: frozen, unknown keys refused. `flag_prefix` goes before a field's name in its
    command-line flag (`add_flags`), for a concern whose field names are too short to stand alone."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)
    flag_prefix: ClassVar[str] = ""

    @classmethod
    def parse(cls: type[S], data: dict[str, Any], *, where: str = "") -> S:
        """`cls(**data)`, a pydantic error turned into a `SettingsError` naming each bad key."""
        try:
            return cls.model_validate(data)
        except ValidationError as err:
            raise SettingsError(_explain(err, where)) from None

    def updated(self: S, changes: dict[str, Any], *, where: str = "") -> S:
        """A copy with `changes` applied and validated; its `given()` are this one's and `changes`."""
        return type(self).parse({**self.given(), **changes}, where=where)

    def given(self) -> dict[str, Any]:
        """The values this surface set itself (a flag given, a key written, a field set), which win over
        the project file's section (`project.sections.effective`); the rest are the defaults."""
        return {name: getattr(self, name) for name in self.model_fields_set}


def _explain(err: ValidationError, where: str) -> str:
    prefix = f"{where}." if where else ""
    return "; ".join(
        f"{prefix}{'.'.join(str(p) for p in e['loc']) or '(settings)'}: {e['msg']}" for e in err.errors()
    )


class ProjectSettings(Settings):
    """What the pipeline trains: a user project, else a built-in example."""

    project: str = unset(
        "a project file (lightning-dagster.yaml) or the folder holding it: its harness runs on "
        "its tasks; empty: the built-in example named by `harness` (commands other than `demo`: the "
        "working directory's project file, unless --harness names an example)"
    )
    harness: Literal["calc", "ledger"] = Field(
        "calc", description="the built-in example project (examples/NAME) used when no project is given"
    )


class StoreSettings(Settings):
    """The durable store: rollouts, attempts, spans, receipts, pointers."""

    flag_prefix: ClassVar[str] = "store"  # `--store-url`: a bare `--url` would not say which

    url: str = unset(
        "a SQLAlchemy URL (postgresql+psycopg2://... for real use); empty: $LD_STORE_URL, else SQLite in the "
        "lightning-dagster home"
    )

    def resolved_url(self) -> str:
        from lightning_dagster import paths

        return self.url or paths.store_url()


class MLflowSettings(Settings):
    """Where candidate lineage and the two pointers live."""

    tracking_uri: str = unset("MLflow tracking URI; empty: $MLFLOW_TRACKING_URI, else SQLite in the home")
    model_name: str = Field("lightning-dagster-policy", min_length=1, description="the registered model")
    ui_url: str = unset(
        "the MLflow UI's address (e.g. http://127.0.0.1:5000) that MLflow pages are linked "
        "under; empty: $LD_MLFLOW_UI_URL, else the tracking server's, else http://127.0.0.1:5000"
    )

    def resolved_uri(self) -> str:
        from lightning_dagster import paths

        return self.tracking_uri or paths.mlflow_tracking_uri()


class ServingSettings(Settings):
    """What serves the policy to the harness and how the harness runs."""

    engine: Literal["embedded", "vllm"] = Field(
        "embedded",
        description="what serves the policy at every stage: embedded (a batched loop over transformers, "
        "nothing to install) or vllm (a vLLM server the gateway starts from the vLLM venv, or `vllm_url`; "
        "the trainer's weights reach it after every step, verified by hash)",
    )
    vllm_url: str = unset(
        "engine vllm: a vLLM server you run (started with the flags README.md gives: the weight-"
        "sync extension, dev mode; it must read the checkpoints the trainer writes); empty: the gateway "
        "starts and owns one"
    )
    vllm_args: list[NonEmpty] = Field(
        default_factory=list,
        description="engine vllm: more `vllm serve` flags for the server the gateway starts (one a value, "
        "e.g. --gpu-memory-utilization then 0.5)",
    )
    vllm_dtype: str = Field(
        "float32",
        min_length=1,
        description="engine vllm: the served weights' dtype (float32 keeps recorded logprobs close to the "
        "trainer's; bfloat16 or auto on a GPU)",
    )
    vllm_enforce_eager: bool = Field(
        True,
        description="engine vllm: no CUDA graphs or compilation (starts in ~30 s on CPU instead of ~1-2 min)",
    )
    upstream_url: str = unset(
        "an OpenAI-compatible server (e.g. vLLM), or several comma-separated (sticky per "
        "rollout, with failover), that serves the parent's rollouts; empty: the embedded engine serves"
    )
    engine_threads: int = at_least(
        1,
        1,
        "torch threads of the embedded engine (one: the harness workers run beside it, and two "
        "OpenMP threads then spin against it; benchmarks/README.md, rollout path)",
    )
    engine_device: str = Field(
        "auto", min_length=1, description="where the embedded engine runs: auto (CUDA when present), cpu, "
        "cuda, cuda:N"
    )  # fmt: skip
    max_batch: int = at_least(1, 64, "the most sequences the embedded engine decodes at once")
    engine_process: bool = Field(
        True,
        description="the embedded engine in a process of its own, so its decode loop does not share an "
        "interpreter lock with the gateway's HTTP server and span writers (benchmarks/README.md, rollout "
        "path); false: a thread of the gateway's process",
    )
    host: str = Field(
        "127.0.0.1", min_length=1, description="the address the gateway binds (attempt keys travel in clear "
        "HTTP: keep it on loopback or a private network)"
    )  # fmt: skip
    port: int = Field(0, ge=0, le=65535, description="the gateway's port; 0: a free port")
    secret: str = unset(
        "the attempt-key signing secret; empty (the default): a fresh random one per run, held in "
        "memory only. Never read from the environment, where a harness could read it; better left empty "
        "under Dagster, which stores and shows run config"
    )
    runner_mode: Literal["inprocess", "subprocess"] = Field(
        "inprocess",
        description="harness attempts as threads of the runner's process (for a harness with an in-process "
        "entry point) or each as a child process, killed on timeout or cancel",
    )
    sandbox: Literal["none", "bwrap"] = Field(
        "none",
        description="bwrap: each subprocess attempt under bubblewrap, in a PID namespace of its own, away "
        "from the gateway's /proc and the home (runner_mode subprocess; docs/SECURITY.md)",
    )
    parallel: int = at_least(
        0,
        0,
        "harness attempts at once; 0 (auto): twice max_batch for in-process attempts (spare "
        "attempts keep the engine's batch full between their turns), max_batch for subprocess ones",
    )

    def attempts_at_once(self) -> int:
        """`parallel`, or what 0 (auto) means for `runner_mode`."""
        if self.parallel:
            return self.parallel
        return self.max_batch * (2 if self.runner_mode == "inprocess" else 1)


def trainer_threads(ranks: int) -> int:
    """torch threads of each trainer rank: $LD_TRAINER_THREADS, else the machine's cores shared by the ranks
    (ranks on one machine share its cores). The receipt records it, as a rerun needs it."""
    return int(os.environ.get("LD_TRAINER_THREADS") or max(1, (os.cpu_count() or 1) // ranks))


class TrainingSettings(Settings):
    """RL, evaluation and checkpoint selection. The defaults are the demo's: 8 steps of 8 tasks x group 16
    at lr 1e-4 with KL 1.0, selection and early stop moved `approved-default` in 4 of 5 seeded demos (0.1:
    3 of 5; benchmarks/README.md, five seeded demos); the closed-set sizes meet the default policy's
    minimums (held-out `min_n` 100)."""

    seed: int = at_least(
        0, 0, "seeds the base model built from scratch, the first parent's warm start, and `train`'s task "
        "draw and sampling"
    )  # fmt: skip
    steps: int = at_least(1, 8, "RL steps, one optimizer update each")
    tasks_per_step: int = at_least(1, 8, "train tasks sampled per step (x group_size rollouts)")
    group_size: int = at_least(
        1,
        16,
        "rollouts per task: one GRPO group (RL learns only from groups of 2 or more whose rewards differ)",
    )
    learning_rate: float = finite(1e-4, "Adam learning rate", ge=0)
    temperature: float = finite(1.0, "sampling temperature of every call of a train rollout", gt=0)
    advantage: Literal["grpo", "dr_grpo", "rloo", "whiten"] = Field(
        "grpo", description="rollout-level advantage mode"
    )
    loss_normalization: Literal["token_mean", "seq_mean_token_mean", "constant"] = Field(
        "token_mean",
        description="how per-token losses are weighted: token_mean, seq_mean_token_mean (each rollout weighs "
        "one) or constant (Dr. GRPO's fixed denominator, loss_constant)",
    )
    loss_constant: float | None = finite(None, "the fixed denominator of loss_normalization constant", gt=0)
    kl_coef: float = finite(
        1.0,
        "weight of the k3 KL to the exact parent in the RL loss (keeps the parent's greedy "
        "behaviour while RL lifts sampled success); 0: off",
        ge=0,
    )
    max_excluded_rollouts: float = Field(
        0.1,
        ge=0,
        le=1,
        description="the share of a step's rollouts that may be left out for an invalid span (NaN or "
        "positive logprobs, negative ids, empty prompt) before the step fails",
    )
    holdout_tasks: int = at_least(1, 128, "held-out tasks the parent and the candidate are compared on")
    protected_tasks: int = at_least(0, 32, "protected cases, decoded greedily, that must not regress")
    canary_tasks: int = at_least(0, 8, "tasks of the bounded canary")
    eval_seed: int = at_least(0, 1234, "one sampling seed for parent and candidate (common random numbers)")
    eval_every: int = at_least(
        1, 10, "`train`: held-out evaluation every N steps (and before the first, after the last)"
    )
    max_attempts: int = at_least(
        1, 1, "attempts per rollout (a retried failure over-represents the samples that succeed on a second "
        "try), for every rollout: train, evaluation, canary"
    )  # fmt: skip
    attempt_timeout_s: float = finite(
        120.0, "seconds one harness attempt may run before it is killed (subprocess) or abandoned "
        "(in-process)", gt=0
    )  # fmt: skip
    validation_tasks: int = at_least(
        0,
        64,
        "train-split tasks outside the train pool each checkpoint is judged on greedily; the "
        "proposed checkpoint keeps every case the parent solved; 0: the last checkpoint",
    )
    validation_every: int = at_least(1, 2, "judge a checkpoint every N steps (and the last)")
    validation_patience: int = at_least(
        0, 2, "stop after N validation evaluations in a row that regressed; 0: never"
    )
    success_threshold: float = Field(
        0.5, gt=0, le=1, description="a task counts as solved (validation, protected cases) at this reward"
    )
    warm_start_max_steps: int = at_least(1, 300, "the first parent's supervised warm start: most steps")
    warm_start_probe_tasks: int = at_least(1, 64, "tasks of the sampled probe that stops the warm start")
    warm_start_demos: int = at_least(1, 2000, "demonstrations the warm start trains on")
    min_serve_rollouts: int = at_least(1, 32, "new rewarded serve rollouts that justify a new snapshot")
    nproc: int = at_least(
        1, 1, "training processes (DistributedDataParallel ranks: gloo on CPU, NCCL on GPU)"
    )
    device: str = Field(
        "auto", min_length=1, description="where the trainer runs: auto (CUDA when present), cpu, cuda"
    )
    adapter: Literal["full", "lora"] = Field(
        "full",
        description="what RL trains: every weight (full), or a LoRA adapter over the frozen parent (lora: "
        "the engine serves the adapter, vLLM by hot-loading it under its name)",
    )
    lora_rank: int = Field(8, ge=1, le=256, description="adapter lora: the rank of each LoRA update")
    lora_alpha: float = finite(16.0, "adapter lora: the scale of the update (alpha / rank)", gt=0)
    lora_targets: list[NonEmpty] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        min_length=1,
        description="adapter lora: the linear layers (module names) that get an adapter",
    )


class GateSettings(Settings):
    """The versioned release policy, who approves, and the bounded canary."""

    policy_path: str = unset("the release policy file; empty: the packaged default")
    roles_path: str = unset(
        "the deployment's roles file (who may approve, with which key), pinned into the "
        "store on first use; empty: the roles pinned already (the code location reads $LD_ROLES_FILE)"
    )
    roles_admin_key: str = unset(
        "the public key (ed25519:...) of the deployment's roles-admin, who signs every change "
        "of the pinned roles; read from the configuration only, never from the store; empty: no roles change "
        "can be verified, so only the configured roles file may be pinned ($LD_ROLES_ADMIN_KEY)"
    )
    pipeline_key_path: str = unset(
        "the pipeline's private key (a 0600 PEM file outside models/ and the MLflow artifacts), "
        "which attests receipts and signs the bootstrap move; empty: receipts are written unattested and the "
        "bootstrap of approved-default is refused ($LD_PIPELINE_KEY)"
    )
    pipeline_public_key: str = unset(
        "the pipeline's public key (ed25519:...) readers verify attestations and the bootstrap "
        "move against; empty: derived from pipeline_key_path ($LD_PIPELINE_PUBLIC_KEY)"
    )
    evaluator: str = Field("heldout-sampled-success", min_length=1, description="the evaluator's name")
    evaluator_version: str = Field("1", min_length=1, description="the evaluator's version")
    scope: str = Field("bounded-canary", min_length=1, description="what a PROMOTE lets the candidate touch")
    canary_approver_roles: list[NonEmpty] = Field(
        default_factory=lambda: ["release-owner"], min_length=1, description="roles that may approve the canary step"
    )  # fmt: skip
    default_approver_roles: list[NonEmpty] = Field(
        default_factory=lambda: ["default-approver"], min_length=1,
        description="roles that may approve moving approved-default",
    )  # fmt: skip
    canary_denied_tools: list[NonEmpty] = Field(
        default_factory=lambda: ["delete_account"], description="tools a canary task may not call"
    )
    canary_max_seconds: float = finite(300.0, "the canary's time limit", gt=0)
    canary_max_cost: float = finite(0.0, "the canary's cost limit", ge=0)
    infrastructure_retry_budget: int = at_least(0, 0, "infrastructure retries check 3 tolerates")


# Where the code location and the commands read the gate's deployment settings from (the configuration, which
# anchors what every read of approved-default and the roles pin verifies against).
GATE_ENV = {
    "policy_path": "LD_GATE_POLICY",
    "roles_path": "LD_ROLES_FILE",
    "roles_admin_key": "LD_ROLES_ADMIN_KEY",
    "pipeline_key_path": "LD_PIPELINE_KEY",
    "pipeline_public_key": "LD_PIPELINE_PUBLIC_KEY",
}


def gate_from_env() -> GateSettings:
    """`GateSettings` with each setting `GATE_ENV` names set from its environment variable, when set."""
    env = {f: os.environ[v] for f, v in GATE_ENV.items() if os.environ.get(v)}
    return GateSettings.parse(env, where="env")


class PipelineSettings(Settings):
    """One pipeline run's settings, nested by concern."""

    project: ProjectSettings = Field(default_factory=ProjectSettings)
    store: StoreSettings = Field(default_factory=StoreSettings)
    mlflow: MLflowSettings = Field(default_factory=MLflowSettings)
    serving: ServingSettings = Field(default_factory=ServingSettings)
    training: TrainingSettings = Field(default_factory=TrainingSettings)
    gate: GateSettings = Field(default_factory=GateSettings)


# Each concern's settings class by its name in a pipeline run (`PipelineSettings`, the project file's sections).
CONCERNS: dict[str, type[Settings]] = {
    name: field.annotation for name, field in PipelineSettings.model_fields.items()
}


def concern_of(cls: type[Settings]) -> type[Settings]:
    """The settings class `cls` is (a Dagster resource inherits one)."""
    return next(base for base in cls.__mro__ if base in CONCERNS.values())


# -------------------------------------------------------------------------------------- CLI flags, generated


def flag_of(name: str, prefix: str = "") -> str:
    """The command-line flag of setting `name`: `learning_rate` -> `--learning-rate`; with a prefix (a
    concern whose field names are short), `url` of the store -> `--store-url`."""
    return "--" + (f"{prefix}_{name}" if prefix else name).replace("_", "-")


def dest_of(cls: type[Settings], name: str, prefix: str | None = None) -> str:
    """The argparse dest of setting `name` of `cls`: its name, after the concern's `flag_prefix`."""
    prefix = cls.flag_prefix if prefix is None else prefix
    return f"{prefix}_{name}" if prefix else name


def _scalar(annotation: Any) -> tuple[Any, bool]:
    """(the non-None type of a field, whether None is allowed)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return next(a for a in typing.get_args(annotation) if a is not type(None)), True
    return annotation, False


def add_flags(
    parser: argparse.ArgumentParser | Any,
    cls: type[Settings],
    names: list[str] | None = None,
    *,
    prefix: str | None = None,
) -> None:
    """One flag per setting of `cls` (all, or `names`), `--[prefix-]setting-name`, its help the setting's
    description with its default. A flag not given leaves the setting alone (`from_flags`)."""
    prefix = cls.flag_prefix if prefix is None else prefix
    for name in names or list(cls.model_fields):
        field = cls.model_fields[name]
        kind, optional = _scalar(field.annotation)
        default = field.get_default(call_default_factory=True)
        help_text = f"{field.description} (default: {'empty' if default in (None, '') else default})"
        dest = dest_of(cls, name, prefix)
        kw: dict[str, Any] = {"dest": dest, "default": argparse.SUPPRESS, "help": help_text}
        flag = flag_of(name, prefix)
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        elif typing.get_origin(kind) is Literal:
            parser.add_argument(flag, choices=typing.get_args(kind), **kw)
        elif typing.get_origin(kind) is list:
            parser.add_argument(flag, action="append", metavar="VALUE", **kw)
        else:
            parser.add_argument(flag, type=_none_or(kind) if optional else kind, **kw)


def _none_or(kind: type) -> Any:
    def convert(text: str) -> Any:
        return None if text in ("", "none") else kind(text)

    convert.__name__ = kind.__name__
    return convert


def from_flags(base: S, args: argparse.Namespace, *, prefix: str | None = None, command: str = "") -> S:
    """`base` with the flags given on the command line applied; `SettingsError` names a bad flag."""
    prefix = type(base).flag_prefix if prefix is None else prefix
    dests = {name: dest_of(type(base), name, prefix) for name in type(base).model_fields}
    given = {name: getattr(args, dest) for name, dest in dests.items() if hasattr(args, dest)}
    try:
        return base.updated(given)
    except SettingsError as err:
        message = str(err)
        for name in given:
            message = message.replace(f"{name}:", f"{flag_of(name, prefix)}:", 1)
        raise SettingsError(f"{command + ': ' if command else ''}{message}") from None
