"""Generated arithmetic word problems whose answer wants the calculator (families add/sub/mul/div/two_step)."""

from __future__ import annotations

import random
from typing import Any

from lightning_dagster.project.splits import draw_tasks, split_of

FAMILIES = ("add", "sub", "mul", "div", "two_step")
SPLIT_WEIGHTS = {"train": 0.7, "holdout": 0.1, "protected": 0.1, "canary": 0.1}
NAMES = ("Ann", "Bo", "Cy", "Dee", "Eve", "Max", "Sam", "Tom")
ITEMS = ("apples", "pens", "cards", "eggs", "books", "coins")


def _problem(family: str, rng: random.Random) -> tuple[str, str, int]:
    """(question, ideal calculator expression, answer); questions stay short for a tiny model."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    if family == "add":
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        return f"{name} has {a} {item} and gets {b} more. How many now?", f"{a}+{b}", a + b
    if family == "sub":
        a = rng.randint(30, 99)
        b = rng.randint(10, a - 1)
        return f"{name} has {a} {item} and gives away {b}. How many left?", f"{a}-{b}", a - b
    if family == "mul":
        a, b = rng.randint(3, 19), rng.randint(3, 19)
        return f"{name} buys {a} boxes of {b} {item}. How many {item}?", f"{a}*{b}", a * b
    if family == "div":
        b, q = rng.randint(2, 9), rng.randint(3, 19)
        a = b * q
        return f"{name} splits {a} {item} among {b} friends. How many each?", f"{a}/{b}", q
    if family == "two_step":
        a, b = rng.randint(3, 12), rng.randint(3, 12)
        c = rng.randint(1, a * b - 1)
        return (
            f"{name} buys {a} boxes of {b} {item} and loses {c}. How many left?",
            f"{a}*{b}-{c}",
            a * b - c,
        )
    raise ValueError(f"unknown calc family {family!r}")


def _candidate(rng: random.Random) -> dict[str, Any]:
    family = rng.choice(FAMILIES)
    question, expression, answer = _problem(family, rng)
    return {"family": family, "question": question, "expression": expression, "answer": answer}


def _assign(task: dict[str, Any]) -> str:
    return split_of(task["task_id"], SPLIT_WEIGHTS)


def make_tasks(split: str, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """`n` calc tasks of `split`: `task_id`, `family`, `question`, `expression` (ideal tool input), `answer`."""
    return draw_tasks("calc", split, n, seed, _candidate, _assign)
