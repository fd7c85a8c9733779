"""Share of rollouts that merge into a single training row, on the project's harnesses through the real
runner + gateway (token-in), against the same traces with every prompt re-tokenized from its text (what a
proxy without token-in records: render the history as text, encode it again).

Run: .venv/bin/python benchmarks/training_merge_share.py [--model DIR] [--n 64]
(a warm-started --model makes multi-call episodes common; the base model mostly answers in one call).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from lightning_dagster.engine.build import build_base_model
from lightning_dagster.harnesses.corpus import training_corpus
from lightning_dagster.project.examples import example_tasks
from lightning_dagster.runner.service import RolloutService
from lightning_dagster.settings import ServingSettings
from lightning_dagster.store import Store
from lightning_dagster.training.transitions import build_rows
from lightning_dagster.types import RolloutKind, Sampling, Span, SpanKind


def retokenized(spans: list[Span], engine) -> list[Span]:
    """Each prompt decoded to text (special tokens kept) and encoded again: the no-token-in capture."""
    out = []
    for s in spans:
        if s.kind == SpanKind.llm and s.prompt_token_ids is not None:
            text = engine.tokenizer.decode(s.prompt_token_ids, skip_special_tokens=False)
            s = s.model_copy(update={"prompt_token_ids": engine.encode(text)})
        out.append(s)
    return out


def share(spans: list[Span]) -> tuple[float, int, int, int]:
    _, stats = build_rows(spans)
    multi = stats.bridges + len(stats.mismatches) + stats.length_splits
    return stats.single_row_attempts / max(stats.attempts, 1), stats.attempts, multi, len(stats.mismatches)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path)
    parser.add_argument("--n", type=int, default=64)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ld-merge-share-"))
    model = args.model or build_base_model(work / "base", corpus=training_corpus())
    store = Store(f"sqlite:///{work / 'store.db'}")
    print(f"{'harness':>8} {'attempts':>8} {'bridges':>8} {'token-in share':>15} {'re-tokenized share':>19} "
          f"{'mismatches':>10}")  # fmt: skip
    for harness in ("calc", "ledger"):
        with RolloutService(store, model, harness=harness, serving=ServingSettings(parallel=16)) as svc:
            tasks = example_tasks(svc.harness.name).draw("train", args.n, 0)
            batch = svc.run(tasks, group=1, kind=RolloutKind.train, sampling=Sampling(temperature=1.0), seed=1,
                             tag=harness)  # fmt: skip
            spans = [s for r in batch.rollouts for s in batch.spans.get(r.rollout_id, [])]
            with_in, attempts, multi, _ = share(spans)
            without, _, _, mism = share(retokenized(spans, svc.codec))
        print(f"{harness:>8} {attempts:>8} {multi:>8} {with_in:>15.3f} {without:>19.3f} {mism:>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
