"""Write the committed data of the built-in example projects from the task generators, once:
`examples/calc/tasks.jsonl`, `examples/calc/demos.jsonl` (ideal episodes for the warm start) and
`examples/ledger/tasks.jsonl`, and the text the example agents exchange, which the embedded default
model's tokenizer is trained on (`lightning_dagster/engine/corpus.json`). Deterministic: re-running it
rewrites the same bytes.

    python scripts/make_example_data.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lightning_dagster.engine.build import CORPUS_FILE
from lightning_dagster.harnesses.calc import demos
from lightning_dagster.harnesses.calc.generate import make_tasks as calc_tasks
from lightning_dagster.harnesses.corpus import training_corpus
from lightning_dagster.harnesses.ledger.generate import make_tasks as ledger_tasks

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
# Rows per split: enough for the demo's plan (128 held-out, 32 protected, 8 canary tasks) with room to spare;
# train rows are drawn in seeded passes, so any number of RL steps is satisfiable.
CALC_ROWS = {"train": 1024, "holdout": 320, "protected": 64, "canary": 16}
LEDGER_ROWS = {"train": 256, "holdout": 128, "protected": 64, "canary": 64}
CALC_DEMOS = 1088  # 64 of them are held out by the warm start to estimate its progress
SEED = 0


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in rows))
    print(f"{path}: {len(rows)} rows")


def main() -> None:
    write_jsonl(
        EXAMPLES / "calc" / "tasks.jsonl",
        [task for split, n in CALC_ROWS.items() for task in calc_tasks(split, n, SEED)],
    )
    # Demonstrations on train tasks of another seed: never a held-out, protected or canary case.
    write_jsonl(
        EXAMPLES / "calc" / "demos.jsonl",
        [
            {"messages": demos.demo_messages(task), "tools": demos.demo_tools()}
            for task in calc_tasks("train", CALC_DEMOS, SEED + 1)
        ],
    )
    write_jsonl(
        EXAMPLES / "ledger" / "tasks.jsonl",
        [task for split, n in LEDGER_ROWS.items() for task in ledger_tasks(split, n, SEED)],
    )
    corpus = training_corpus(seed=SEED)
    CORPUS_FILE.write_text(json.dumps(corpus, indent=0) + "\n")
    print(f"{CORPUS_FILE}: {len(corpus)} texts")


if __name__ == "__main__":
    main()
