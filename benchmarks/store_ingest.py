"""Store ingest: spans/s of `Store.add_spans` in batches and one by one, and bytes kept, on SQLite and on a
PostgreSQL server this script starts itself, each beside a naive store (one JSON document per span with
the full token lists) on the same backend in the same run.

Workload: multi-turn tool rollouts, 10 LLM calls each with ~1k-token prompts (every prompt extends the
previous prompt + response by a 15-token tool result), one tool span per call.

Read = `list_spans` over all rollouts (token arrays rebuilt) against parsing the naive JSON rows.
Rates are given per wall second and per CPU second (this process + the PostgreSQL server's processes):
on a shared, oversubscribed machine the wall figure measures the neighbours as much as the store.

    .venv/bin/python benchmarks/store_ingest.py [--rollouts 250] [--batch 500] [--single 200]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from array import array
from collections.abc import Callable
from pathlib import Path

import psutil
import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.support.postgres

from lightning_dagster.store import Store  # noqa: E402
from lightning_dagster.store.schema import spans as spans_table  # noqa: E402
from lightning_dagster.types import Rollout, Span, SpanKind  # noqa: E402
from tests.support.postgres import PostgresServer  # noqa: E402

TURNS, PROMPT, TOOL = 10, 1000, 15
TOKEN_FIELDS = {"prompt_token_ids", "response_token_ids", "response_logprobs"}
naive_metadata = sa.MetaData()
naive_spans = sa.Table(
    "naive_spans",
    naive_metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("span_id", sa.String(64), nullable=False, unique=True),
    sa.Column("body", sa.Text, nullable=False),
)


def rollout_spans(rollout_id: str, attempt_id: str, rng: random.Random) -> list[Span]:
    prompt = [rng.randrange(150_000) for _ in range(PROMPT)]
    spans = []
    for turn in range(TURNS):
        response = [rng.randrange(150_000) for _ in range(rng.randrange(20, 60))]
        common = {"rollout_id": rollout_id, "attempt_id": attempt_id, "trace_id": attempt_id}
        spans.append(
            Span(
                **common,
                sequence=2 * turn,
                name="chat.completions",
                kind=SpanKind.llm,
                prompt_token_ids=prompt,
                response_token_ids=response,
                # engines produce float32 logprobs (see lightning_dagster/store/tokens.py)
                response_logprobs=array("f", [-rng.random() * 3 for _ in response]).tolist(),
                finish_reason="stop",
                resource_id="res-bench",
                attributes={"token_in": turn > 0, "model": "policy"},
            )
        )
        spans.append(Span(**common, sequence=2 * turn + 1, name="calculator", kind=SpanKind.tool))
        prompt = prompt + response + [rng.randrange(150_000) for _ in range(TOOL)]
    return spans


def workload(store: Store, n_rollouts: int, seed: int) -> list[Span]:
    rng = random.Random(seed)
    store.enqueue_rollouts([Rollout(task_id=str(i)) for i in range(n_rollouts)])
    spans = []
    while claimed := store.claim_rollout("bench"):
        spans += rollout_spans(claimed[0].rollout_id, claimed[1].attempt_id, rng)
    return spans


def server_cpu(pid: int | None) -> float:
    """CPU seconds used so far by a PostgreSQL server: postmaster, live backends, and reaped backends."""
    if pid is None:
        return 0.0
    master = psutil.Process(pid)
    t = master.cpu_times()
    total = t.user + t.system + t.children_user + t.children_system
    for child in master.children(recursive=True):
        try:
            ct = child.cpu_times()
            total += ct.user + ct.system
        except psutil.NoSuchProcess:
            pass
    return total


def rates(fn: Callable[[list], None], items: list, batch: int, pg_pid: int | None) -> tuple[float, float]:
    """(spans per wall second, spans per CPU second of client + server)."""
    wall, cpu, server = time.perf_counter(), time.process_time(), server_cpu(pg_pid)
    for i in range(0, len(items), batch):
        fn(items[i : i + batch])
    used = time.process_time() - cpu + server_cpu(pg_pid) - server
    return len(items) / (time.perf_counter() - wall), len(items) / used


def naive_add(engine: sa.Engine) -> Callable[[list[Span]], None]:
    def add(spans: list[Span]) -> None:
        with engine.begin() as c:
            c.execute(
                naive_spans.insert(), [{"span_id": s.span_id, "body": s.model_dump_json()} for s in spans]
            )

    return add


def table_bytes(engine: sa.Engine, table: str) -> int:
    """PostgreSQL: the table with indexes and TOAST; SQLite: the whole file after a WAL checkpoint."""
    with engine.connect() as c:
        if engine.dialect.name == "postgresql":
            return c.exec_driver_sql(f"SELECT pg_total_relation_size('{table}')").scalar()
        c.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
    return Path(engine.url.database).stat().st_size


def measure(compact_url: str, naive_url: str, args, pg_pid: int | None = None) -> dict[str, dict]:
    store = Store(compact_url)
    naive = sa.create_engine(naive_url)
    naive_metadata.create_all(naive)
    spans = workload(store, args.rollouts, seed=0)
    # one span per call, as the gateway records them
    singles = workload(store, -(-args.single // (2 * TURNS)), seed=1)[: args.single]
    out: dict[str, dict] = {}
    for name, add in (("store", store.add_spans), ("naive JSON", naive_add(naive))):
        wall, cpu = rates(add, spans, args.batch, pg_pid)
        single_wall, _ = rates(add, singles, 1, pg_pid)
        out[name] = {"wall": wall, "cpu": cpu, "single": single_wall}
    # read back every rollout's spans, as the trainer and the gate do
    ids = sorted({s.rollout_id for s in spans + singles})
    wall = time.perf_counter()
    read = store.list_spans(rollout_ids=ids)
    out["store"]["read"] = len(read) / (time.perf_counter() - wall)
    wall = time.perf_counter()
    with naive.connect() as c:
        naive_read = [
            Span.model_validate_json(body) for body in c.execute(sa.select(naive_spans.c.body)).scalars()
        ]
    out["naive JSON"]["read"] = len(naive_read) / (time.perf_counter() - wall)
    assert len(read) == len(naive_read) == len(spans) + len(singles)
    assert sorted(read, key=lambda s: s.span_id) == sorted(spans + singles, key=lambda s: s.span_id)
    t = spans_table.c
    with store.engine.connect() as c:
        token_cols = [t.prompt_tail, t.response_ids, t.response_logprobs, t.prompt_ref]
        out["store"]["token_bytes"] = c.execute(
            sa.select(sa.func.sum(sum(sa.func.coalesce(sa.func.length(col), 0) for col in token_cols)))
        ).scalar()
    out["naive JSON"]["token_bytes"] = sum(
        len(s.model_dump_json(include=TOKEN_FIELDS)) for s in spans + singles
    )
    out["store"]["table_bytes"] = table_bytes(store.engine, "spans")
    out["naive JSON"]["table_bytes"] = table_bytes(naive, "naive_spans")
    store.close()
    naive.dispose()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=250)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--single", type=int, default=200)
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        results["sqlite"] = measure(f"sqlite:///{tmp}/compact.db", f"sqlite:///{tmp}/naive.db", args)
    server = PostgresServer().start()
    try:
        pid = int((server.data / "postmaster.pid").read_text().split()[0])
        urls = [server.url(server.create_database("bench")) for _ in range(2)]
        results["postgresql"] = measure(*urls, args, pg_pid=pid)
    finally:
        server.stop()

    n = args.rollouts * TURNS * 2
    print(f"{n} spans: {args.rollouts} rollouts x {TURNS} LLM calls (~{PROMPT}-token prompts) + tool spans")
    print(f"batches of {args.batch}; single = one add_spans call per span ({args.single} spans)\n")
    cols = ("wall", "cpu", "single", "read", "token_bytes", "table_bytes")
    widths = (9, 12, 9, 9, 12, 12)
    print(f"{'backend':<11} {'store':<11} {'spans/s':>9} {'spans/cpu-s':>12} {'single/s':>9} "
          f"{'read/s':>9} {'token bytes':>12} {'table bytes':>12}")  # fmt: skip
    for backend, by_store in results.items():
        for name, r in by_store.items():
            print(
                f"{backend:<11} {name:<11} "
                + " ".join(f"{r[c]:>{w},.0f}" for c, w in zip(cols, widths, strict=True))
            )
        s, j = by_store["store"], by_store["naive JSON"]
        print(
            f"{backend:<11} {'ratio':<11} "
            + " ".join(f"{s[c] / j[c]:>{w}.3f}" for c, w in zip(cols, widths, strict=True))
        )


if __name__ == "__main__":
    main()
