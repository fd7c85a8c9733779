"""Project side of the calc harness: a fresh destination per attempt that the agent posts its final answer to
(as a real workflow posts an answer), re-read afterwards by `verify` (the canary's "verified outcome")."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lightning_dagster.harnesses.calc.agent import score


def prepare(task: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """Write `workdir/answer.json` holding null (nothing posted yet); return the task with `answer_path`."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "answer.json").write_text("null")
    return {**task, "answer_path": str(workdir / "answer.json")}


def verify(task: dict[str, Any]) -> dict[str, Any]:
    """Re-read the posted answer; `harmful_effect` None if unreadable, else False (posting harms nothing)."""
    try:
        posted = json.loads(Path(task["answer_path"]).read_text())
    except (KeyError, OSError, ValueError) as exc:
        return {"verified": False, "effect_ok": False, "harmful_effect": None, "reason": f"unreadable: {exc}"}
    ok = type(posted) in (int, float) and score(posted, task["answer"]) == 1.0
    reason = "ok" if ok else "no answer posted" if posted is None else f"wrong answer {posted!r}"
    return {"verified": True, "effect_ok": ok, "harmful_effect": False, "posted": posted, "reason": reason}
