"""`Store` is composed of one mixin per concern; callers see the same class as before the split: every
public method, with the same signature, and the package's exported names."""

from __future__ import annotations

import inspect

import lightning_dagster.store as store_package
from lightning_dagster.store import Store

# The public methods of the single-module Store before it was split, with their signatures, and the plain
# sqlite3 read and write the Agent Lightning surface shares with span inserts.
PUBLIC_METHODS = {
    "add_resource": "(self, r: 'Resource') -> 'Resource'",
    "add_reward": "(self, r: 'Reward', *, span: 'Span | None' = None, request_id: 'str | None' = None) -> 'str | None'",
    "add_spans": "(self, spans: 'list[Span]', *, sync: 'bool' = True) -> 'None'",
    "append_document": "(self, collection: 'str', doc_id: 'str', content_hash: 'str', body: 'dict', previous_hash: 'str | None') -> 'int'",
    "attempt_facts": "(self, attempt_id: 'str') -> 'tuple[str, AttemptState, RolloutKind, dict, int | None, str | None]'",
    "claim_rollout": "(self, worker_id: 'str', *, kinds: 'RolloutKind | str | Iterable[RolloutKind | str] | None' = None, snapshot_key: 'str | None' = None, rollout_ids: 'Iterable[str] | None' = None, harness: 'str | None' = None, policy_versions: 'Iterable[int] | None' = None) -> 'tuple[Rollout, Attempt] | None'",
    "close": "(self) -> 'None'",
    "count_rollouts": "(self, *, status: 'RolloutStatus | str | Iterable[RolloutStatus | str] | None' = None, rollout_ids: 'Iterable[str] | None' = None, harness: 'str | None' = None) -> 'int'",
    "count_spans": "(self, *, rollout_ids: 'Iterable[str] | None' = None, kind: 'SpanKind | str | Iterable[SpanKind | str] | None' = None, rollout_id: 'str | None' = None, attempt_id: 'str | None' = None) -> 'int'",
    "current_pointer": "(self, name: 'str') -> 'str | None'",
    "document_versions": "(self, collection: 'str', doc_id: 'str') -> 'list[StoredDocument]'",
    "enqueue_rollouts": "(self, rollouts: 'list[Rollout]') -> 'list[Rollout]'",
    "finish_rollout": "(self, rollout_id: 'str', status: 'RolloutStatus') -> 'None'",
    "fleet_version": "(self, live_within_s: 'float' = 10.0) -> 'int | None'",
    "get_attempt": "(self, attempt_id: 'str') -> 'Attempt'",
    "get_flag": "(self, key: 'str') -> 'dict | None'",
    "get_or_create_serve_rollout": "(self, session: 'str', resource_id: 'str | None', *, owner: 'str | None' = None) -> 'tuple[Rollout, Attempt]'",
    "get_resource": "(self, resource_id: 'str') -> 'Resource'",
    "get_rollout": "(self, rollout_id: 'str') -> 'Rollout'",
    "heartbeat": "(self, attempt_id: 'str') -> 'None'",
    "list_attempts": "(self, *, rollout_id: 'str | None' = None, rollout_ids: 'Iterable[str] | None' = None, state: 'AttemptState | str | Iterable[AttemptState | str] | None' = None) -> 'list[Attempt]'",
    "list_resources": "(self) -> 'list[Resource]'",
    "list_rewards": "(self, *, rollout_ids: 'Iterable[str] | None' = None, rollout_id: 'str | None' = None) -> 'list[Reward]'",
    "list_spans": "(self, *, rollout_id: 'str | None' = None, attempt_id: 'str | None' = None, rollout_ids: 'Iterable[str] | None' = None, kind: 'SpanKind | str | Iterable[SpanKind | str] | None' = None) -> 'list[Span]'",
    "move_pointer": "(self, name: 'str', *, expected: 'str | None', to: 'str', actor: 'str', receipt_id: 'str | None' = None, note: 'str' = '', expected_seq: 'int | None' = None) -> 'PointerMove'",
    "pointer_state": "(self, name: 'str') -> 'tuple[str | None, int]'",
    "pointer_history": "(self, name: 'str', *, last: 'int | None' = None) -> 'list[PointerMove]'",
    "publish_policy": "(self, resource_id: 'str', path: 'str', weights_hash: 'str') -> 'PolicyVersion'",
    "published_policy": "(self) -> 'PolicyVersion | None'",
    "raw_read": "(self, sql: 'str', params: 'Iterable[Any]' = ()) -> 'list[tuple]'",
    "raw_write": "(self, *, synchronous: 'int', nowait: 'bool') -> 'Iterator[sqlite3.Connection | None]'",
    "query_rollouts": "(self, *, snapshot_key: 'str | None' = None, kind: 'RolloutKind | str | Iterable[RolloutKind | str] | None' = None, status: 'RolloutStatus | str | Iterable[RolloutStatus | str] | None' = None, created_after: 'float | None' = None, rollout_ids: 'Iterable[str] | None' = None, group_ids: 'Iterable[str] | None' = None, harness: 'str | None' = None, limit: 'int | None' = None) -> 'list[Rollout]'",
    "report_serving": "(self, report: 'ServingReport') -> 'None'",
    "retry_rollout": "(self, rollout_id: 'str', retry_kind: 'RetryKind', *, delay_s: 'float' = 0.0) -> 'Attempt'",
    "serving_processes": "(self, live_within_s: 'float' = 10.0) -> 'list[ServingReport]'",
    "set_flag": "(self, key: 'str', value: 'dict') -> 'None'",
    "stale_attempts": "(self, cutoff: 'float', *, harness: 'str | None' = None, rollout_ids: 'Iterable[str] | None' = None) -> 'list[Attempt]'",
    "start_attempt": "(self, attempt_id: 'str', worker_id: 'str') -> 'Attempt'",
    "transition_attempt": "(self, attempt_id: 'str', target: 'AttemptState', *, reason_code: 'str | None' = None, reason_message: 'str | None' = None) -> 'Attempt'",
    "try_add_spans": "(self, spans: 'list[Span]', *, sync: 'bool' = True) -> 'bool'",
}


def test_the_store_facade_keeps_every_public_method_and_signature() -> None:
    public = {
        name: str(inspect.signature(member))
        for name, member in inspect.getmembers(Store, inspect.isfunction)
        if not name.startswith("_")
    }
    assert public == PUBLIC_METHODS
    assert str(inspect.signature(Store)) == "(url: 'str | None' = None, *, busy_timeout_s: 'float' = 30.0)"


def test_the_store_package_exports_the_same_names() -> None:
    assert sorted(store_package.__all__) == [
        "Conflict",
        "IllegalTransition",
        "InvalidInput",
        "NotFound",
        "PointerConflict",
        "PointerMove",
        "PointerSeqConflict",
        "Store",
        "StoredDocument",
    ]
    assert all(hasattr(store_package, name) for name in store_package.__all__)
