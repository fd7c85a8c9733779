"""Registry fixtures: one tiny base checkpoint, weight variants of it, and both MLflow backends.

`tracking` is parametrized: `sqlite` (a SQLite tracking store in a temp dir, store on SQLite) and `postgres`
(a real `mlflow server` on a PostgreSQL backend store with proxied artifacts, store on PostgreSQL), each
started once per session. Tests isolate themselves by registered model name and a fresh store.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.registry.mlflow_server import MlflowServer


@pytest.fixture(scope="session", autouse=True)
def _home(tmp_path_factory):
    """Keep the embedded default's working directory (models dir, artifact root) out of the repository."""
    home = tmp_path_factory.mktemp("ld-home")
    old = os.environ.get("LIGHTNING_DAGSTER_HOME")
    os.environ["LIGHTNING_DAGSTER_HOME"] = str(home)
    yield home
    if old is None:
        os.environ.pop("LIGHTNING_DAGSTER_HOME", None)
    else:
        os.environ["LIGHTNING_DAGSTER_HOME"] = old


@pytest.fixture(scope="session")
def base_checkpoint(tmp_path_factory) -> Path:
    from lightning_dagster.engine import build_base_model
    from lightning_dagster.harnesses.corpus import training_corpus

    return build_base_model(tmp_path_factory.mktemp("base") / "model", corpus=training_corpus(seed=0), seed=0)


@pytest.fixture(scope="session")
def variant(base_checkpoint, tmp_path_factory):
    """`variant(k)`: the base checkpoint with one tensor nudged by a seeded amount (distinct weights per k)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("variants")

    def make(k: int) -> Path:
        out = root / f"v{k}"
        if out.is_dir():
            return out
        shutil.copytree(base_checkpoint, out)
        tensors = load_file(str(out / "model.safetensors"))
        name = sorted(tensors)[0]
        generator = torch.Generator().manual_seed(1000 + k)
        tensors[name] = tensors[name] + 1e-3 * torch.randn(tensors[name].shape, generator=generator)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return out

    return make


APPROVERS = {
    "alice": ["release-owner", "ml-lead", "default-approver", "roles-admin"],
    "bob": ["ml-lead"],
    **{f"racer{i}": ["release-owner"] for i in range(8)},
}


@pytest.fixture(scope="session")
def approver_keys(tmp_path_factory) -> dict[str, Path]:
    """Private key files of the deployment's approvers, and of `mallory`, whom no roles file names."""
    from lightning_dagster.release.signing import generate_keypair

    out = tmp_path_factory.mktemp("approver-keys")
    return {actor: generate_keypair(actor, out).private_path for actor in [*APPROVERS, "mallory"]}


@pytest.fixture(scope="session")
def roles_file(tmp_path_factory, approver_keys) -> Path:
    """The deployment's actors, roles and public keys, outside the learner's write surface."""
    from lightning_dagster.release.signing import load_private_key, public_key_line

    path = tmp_path_factory.mktemp("policy-config") / "roles.yaml"
    entries = "".join(
        f"  {actor}:\n    roles: [{', '.join(roles)}]\n"
        f"    key: {public_key_line(load_private_key(approver_keys[actor]))}\n"
        for actor, roles in APPROVERS.items()
    )
    path.write_text("actors:\n" + entries)
    return path


@pytest.fixture(scope="session")
def deployment_keys(tmp_path_factory) -> dict[str, Path]:
    """The deployment's own keys: the pipeline's (signs the bootstrap move) and the roles-admin's."""
    from lightning_dagster.release.signing import generate_keypair

    out = tmp_path_factory.mktemp("deployment-keys")
    return {actor: generate_keypair(actor, out).private_path for actor in ("pipeline", "roles-admin")}


@pytest.fixture(autouse=True)
def _deployment(roles_file, deployment_keys, monkeypatch):
    """The deployment's configuration, as the code location and every command read it: its roles file, the
    pipeline's key and the roles-admin's public key. Set per test, from the keys this test's fixtures made:
    `tests/release` imports these fixtures into a second set of session instances, and the order pytest runs
    the two backends in interleaves the directories, so a session-wide environment would belong to one of
    the two sets only."""
    admin = deployment_keys["roles-admin"].with_suffix(".pub").read_text().strip()
    monkeypatch.delenv("LD_PIPELINE_PUBLIC_KEY", raising=False)
    monkeypatch.setenv("LD_ROLES_FILE", str(roles_file))
    monkeypatch.setenv("LD_PIPELINE_KEY", str(deployment_keys["pipeline"]))
    monkeypatch.setenv("LD_ROLES_ADMIN_KEY", admin)


@dataclass
class Tracking:
    kind: str
    uri: str
    artifact_root: Path | None
    server: MlflowServer | None = None


@pytest.fixture(scope="session", params=["sqlite", "postgres"])
def tracking(request, tmp_path_factory) -> Tracking:
    from lightning_dagster.registry import ensure_tracking_store

    root = tmp_path_factory.mktemp(f"mlflow-{request.param}")
    if request.param == "sqlite":
        uri = f"sqlite:///{root / 'mlflow.db'}"
        ensure_tracking_store(uri)
        yield Tracking("sqlite", uri, root / "artifacts")
        return
    pg = request.getfixturevalue("postgres_server")
    server = MlflowServer(
        pg.url(pg.create_database("mlflow")), root / "artifacts", root / "server.log"
    ).start()
    try:
        yield Tracking("postgres", server.url, None, server)
    finally:
        server.stop()


@pytest.fixture
def new_store_url(request, tracking, tmp_path):
    """`new_store_url()`: a URL to a new, empty store (SQLite file, or a new PostgreSQL database)."""
    counter = iter(range(1000))

    def make() -> str:
        if tracking.kind == "postgres":
            pg = request.getfixturevalue("postgres_server")
            return pg.url(pg.create_database())
        return f"sqlite:///{tmp_path / f'store{next(counter)}.db'}"

    return make


@pytest.fixture
def store_url(new_store_url) -> str:
    return new_store_url()


@pytest.fixture
def make_registry(tracking, store_url, roles_file, deployment_keys, tmp_path):
    """Registries on one model name and one store (as separate processes would build them); the pipeline's
    receipts on it are attested by the deployment's pipeline key, as the code location's are."""
    from lightning_dagster.gate.ledger import use_keys
    from lightning_dagster.registry import Registry
    from lightning_dagster.release.pipeline_key import keys
    from lightning_dagster.settings import GateSettings
    from lightning_dagster.store import Store

    model_name = f"policy-{uuid.uuid4().hex[:8]}"
    stores: list = []
    pipeline = keys(GateSettings(pipeline_key_path=str(deployment_keys["pipeline"])))

    def make() -> Registry:
        store = Store(store_url)
        use_keys(store, pipeline)
        stores.append(store)
        return Registry(
            tracking.uri,
            store,
            model_name,
            tracking.artifact_root,
            cache_dir=tmp_path / "cache",
            roles_file=roles_file,
        )

    yield make
    for store in stores:
        store.close()


@pytest.fixture
def registry(make_registry):
    return make_registry()
