"""Release fixtures: the registry's (a tiny base checkpoint and its weight variants, both MLflow backends,
a fresh store, the deployment's approvers with their keys and roles file), since every approval, promotion
and rollback acts on a real registry's pointer."""

from tests.registry.conftest import (  # noqa: F401 - fixtures, found by name
    _deployment,
    _home,
    approver_keys,
    base_checkpoint,
    deployment_keys,
    make_registry,
    new_store_url,
    registry,
    roles_file,
    store_url,
    tracking,
    variant,
)
