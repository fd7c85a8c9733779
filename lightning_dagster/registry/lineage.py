"""Registering a version: one MLflow run with its whole lineage (parameters, curve, snapshots, checkpoint,
receipt, plot) written before the version exists.
"""

from __future__ import annotations

import io
import json
import math
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlflow import MlflowClient
from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param, RunTag

from lightning_dagster.registry.errors import RegistryError

if TYPE_CHECKING:
    from lightning_dagster.registry.core import Registry

# MLflow rejects dataset digests longer than this (mlflow.utils.validation.MAX_DATASET_DIGEST_SIZE).
DIGEST_CHARS = 36
PARAM_CHARS = 6000
BATCH = 900  # under MLflow's 1000 metrics / 100 params per log_batch request
FILES_HASH_TAG = "files_hash"
FILES_MANIFEST_TAG = "files_manifest"


@dataclass(frozen=True)
class SnapshotRef:
    """A frozen data snapshot (name: its partition key); `records`: its task dicts, `uri`: their file."""

    name: str
    content_hash: str
    rows: int
    records: tuple[Mapping[str, Any], ...] = ()
    uri: str = ""

    def __post_init__(self) -> None:
        if self.records and len(self.records) != self.rows:
            raise ValueError(f"snapshot {self.name}: {self.rows} rows but {len(self.records)} records")

    @classmethod
    def of(cls, value: SnapshotRef | Mapping[str, Any]) -> SnapshotRef:
        if isinstance(value, SnapshotRef):
            return value
        try:
            name, content_hash, rows = str(value["name"]), str(value["content_hash"]), int(value["rows"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"snapshot needs name, content_hash and rows: {value!r}") from exc
        return cls(name, content_hash, rows, tuple(value.get("records", ())), str(value.get("uri", "")))


@dataclass(frozen=True)
class CandidateVersion:
    """A registered version's identities, typed where MLflow hands them out (never parsed from a URI). The
    weights hash is the key that survives a re-created registered model, whose version numbers restart."""

    version: str
    run_id: str
    weights_hash: str  # "" for a version this registry did not register
    model_uri: str  # `models:/<model>/<version>`
    files_hash: str = ""  # the non-weight files' hash (`checkpoints.files_hash`); "" if registered before it
    files_list: str = ""  # the `files_manifest` tag: JSON {relative path: sha256}; "" when too long

    @classmethod
    def of(cls, mv: Any, model_name: str) -> CandidateVersion:
        """From an MLflow `ModelVersion`; the hashes are the tags `register_version` wrote."""
        return cls(
            version=str(mv.version),
            run_id=mv.run_id,
            weights_hash=mv.tags.get("weights_hash", ""),
            model_uri=model_uri(model_name, mv.version),
            files_hash=mv.tags.get(FILES_HASH_TAG, ""),
            files_list=mv.tags.get(FILES_MANIFEST_TAG, ""),
        )

    @property
    def files_manifest(self) -> dict[str, str] | None:
        """The registered non-weight files' sha256, None when not recorded (or unreadable)."""
        try:
            manifest = json.loads(self.files_list) if self.files_list else None
        except ValueError:
            return None
        return manifest if isinstance(manifest, dict) else None


def model_uri(model_name: str, version: str | int) -> str:
    return f"models:/{model_name}/{version}"


def flatten_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested configuration -> dotted MLflow parameters (values as JSON-ish strings, capped in length)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten_params(value, f"{name}."))
        else:
            text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
            out[name] = text[:PARAM_CHARS]
    return out


def step_metrics(metrics_per_step: Sequence[Mapping[str, float]]) -> list[Metric]:
    """One MLflow metric per (step, name); a row's `step` key wins over its index. NaN/inf are refused."""
    now_ms = int(time.time() * 1000)
    metrics: list[Metric] = []
    for index, row in enumerate(metrics_per_step):
        step = int(row.get("step", index))
        for name, value in row.items():
            if name == "step":
                continue
            value = float(value)
            if not math.isfinite(value):
                raise ValueError(f"metric {name!r} at step {step} is not finite: {value}")
            metrics.append(Metric(key=name, value=value, timestamp=now_ms, step=step))
    return metrics


# The training plot's panels: (title, metric key); `reward_mean`: the mean reward the step trained on.
PLOT_PANELS = (("reward (mean per step)", "reward_mean"), ("loss", "loss"))


def plot_series(metrics_per_step: Sequence[Mapping[str, float]]) -> dict[str, list[tuple[int, float]]]:
    """The points each panel of the training plot draws: metric key -> [(step, value)] in step order."""
    return {
        key: sorted(
            (int(r.get("step", j)), float(r[key])) for j, r in enumerate(metrics_per_step) if key in r
        )
        for _, key in PLOT_PANELS
    }


def training_plot_png(metrics_per_step: Sequence[Mapping[str, float]]) -> bytes:
    """Reward and loss over training steps, as PNG bytes (Agg backend: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    series = plot_series(metrics_per_step)
    fig = Figure(figsize=(8, 3.2), dpi=100)
    for i, (title, key) in enumerate(PLOT_PANELS):
        ax = fig.add_subplot(1, 2, i + 1)
        points = series[key]
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker=".")
        else:
            ax.text(0.5, 0.5, f"no {key} recorded", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def dataset_input(snapshot: SnapshotRef, context: str) -> DatasetInput:
    """A snapshot as an MLflow dataset (digest: the hash's first 36 hex digits)."""
    import mlflow.data
    import pandas as pd

    digest = snapshot.content_hash.split(":", 1)[-1][:DIGEST_CHARS]
    source = {"snapshot": snapshot.name, "content_hash": snapshot.content_hash}
    with warnings.catch_warnings():
        # MLflow's hint that integer columns cannot hold missing values concerns model signatures, not data.
        warnings.simplefilter("ignore", UserWarning)
        dataset = mlflow.data.from_pandas(
            pd.DataFrame(list(snapshot.records)), name=snapshot.name, digest=digest
        ).to_dict()
    dataset |= {
        # the frozen content's hash and file, in place of the code location MLflow would infer
        "source_type": "lightning-dagster-snapshot",
        "source": json.dumps(source | ({"uri": snapshot.uri} if snapshot.uri else {})),
        "profile": json.dumps({"num_rows": snapshot.rows}),
    }
    return DatasetInput(dataset=Dataset(**dataset), tags=[InputTag(key="mlflow.data.context", value=context)])


@dataclass(frozen=True)
class LineageRun:
    run_id: str
    checkpoint_uri: str
    model_id: str


@dataclass(frozen=True)
class Timing:
    started_at: float
    ended_at: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.started_at) and math.isfinite(self.ended_at)):
            raise ValueError(f"run times must be finite: {self.started_at}, {self.ended_at}")
        if self.ended_at < self.started_at:
            raise ValueError(f"run ends ({self.ended_at}) before it starts ({self.started_at})")


def _ms(seconds: float) -> int:
    return int(round(seconds * 1000))


def log_lineage_run(
    client: MlflowClient,
    experiment_id: str,
    *,
    run_name: str,
    checkpoint_dir: Path,
    params: Mapping[str, Any],
    tags: Mapping[str, str],
    metrics_per_step: Sequence[Mapping[str, float]] = (),
    snapshots: Sequence[tuple[SnapshotRef, str]] = (),
    receipt: Mapping[str, Any] | None = None,
    timing: Timing | None = None,
) -> LineageRun:
    """Log a finished run with the checkpoint and a logged model (MLflow 3 files one without as eval)."""
    from mlflow.entities import LoggedModelOutput

    metrics = step_metrics(metrics_per_step)  # validate before anything is written
    start = None if timing is None else _ms(timing.started_at)
    run = client.create_run(experiment_id, start_time=start, run_name=run_name, tags=dict(tags))
    run_id = run.info.run_id
    try:
        flat = [Param(k, v) for k, v in flatten_params(params).items()]
        for i in range(0, len(flat), 90):
            client.log_batch(run_id, params=flat[i : i + 90])
        for i in range(0, len(metrics), BATCH):
            client.log_batch(run_id, metrics=metrics[i : i + BATCH])
        if snapshots:
            client.log_inputs(run_id, datasets=[dataset_input(s, ctx) for s, ctx in snapshots])
        client.log_artifacts(run_id, str(checkpoint_dir), "checkpoint")
        if receipt is not None:
            client.log_dict(run_id, dict(receipt), "receipt/receipt.json")
        if metrics_per_step:
            _log_bytes(client, run_id, training_plot_png(metrics_per_step), "plots/training.png")
        checkpoint_uri = f"{run.info.artifact_uri}/checkpoint"
        # The logged model is a record (the checkpoint stays in the run's artifacts, never copied twice).
        model = client.create_logged_model(
            experiment_id,
            name=run_name,
            source_run_id=run_id,
            tags={**tags, "checkpoint_uri": checkpoint_uri},
            model_type="checkpoint",
        )
        client.finalize_logged_model(model.model_id, "READY")
        last_step = max((m.step for m in metrics), default=0)
        client.log_outputs(run_id, [LoggedModelOutput(model.model_id, last_step)])
        client.log_batch(run_id, tags=[RunTag("lightning_dagster.status", "complete")])
        client.set_terminated(run_id, "FINISHED", end_time=None if timing is None else _ms(timing.ended_at))
    except BaseException:
        try:
            client.set_terminated(run_id, "FAILED")
        except Exception:  # the original error is the one worth reporting
            pass
        raise
    return LineageRun(run_id, checkpoint_uri, model.model_id)


def _log_bytes(client: MlflowClient, run_id: str, data: bytes, artifact_file: str) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / Path(artifact_file).name
        path.write_bytes(data)
        client.log_artifact(run_id, str(path), str(Path(artifact_file).parent))


def register_version(
    reg: Registry, checkpoint_dir: Path, *, tags: Mapping[str, str], **lineage: Any
) -> CandidateVersion:
    """Hash the weights, log the run (`lineage`: `log_lineage_run`'s arguments), register the version."""
    from lightning_dagster.registry import checkpoints

    if not checkpoint_dir.is_dir():
        raise RegistryError(f"checkpoint directory {checkpoint_dir} does not exist")
    reg.connect()
    weights_hash = checkpoints.weights_hash(checkpoint_dir)
    manifest = checkpoints.files_manifest(checkpoint_dir)  # refuses a symlink leaving the checkpoint
    files_hash = checkpoints.manifest_hash(manifest)
    files_list = checkpoints.manifest_tag(manifest) or ""
    tagged = {k: str(v) for k, v in tags.items() if v not in (None, "")} | {
        "weights_hash": weights_hash,
        FILES_HASH_TAG: files_hash,
        **({FILES_MANIFEST_TAG: files_list} if files_list else {}),
    }
    c, m, call = reg.client, reg.model_name, reg.call_mlflow
    lineage |= {"checkpoint_dir": checkpoint_dir, "tags": tagged}
    run = call("log lineage run", log_lineage_run, c, reg.experiment_id, **lineage)
    mv = call(
        "create model version", c.create_model_version, m, run.checkpoint_uri, run_id=run.run_id, tags=tagged
    )
    version = str(mv.version)
    # As MLflow's own `register_model` does: the logged model names its registered versions.
    names = json.dumps([{"name": m, "version": version}])
    call("tag logged model", c.set_logged_model_tags, run.model_id, {"mlflow.modelVersions": names})
    # Built from what was just written: a server's reply need not echo the tags.
    return CandidateVersion(version, run.run_id, weights_hash, model_uri(m, version), files_hash, files_list)
