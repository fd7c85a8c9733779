"""A Calc-X style tool agent: ask the model, run its `calculator` calls, read `ANSWER: <number>`. The reward
is correctness alone (a format bonus gets gamed)."""

from __future__ import annotations

import ast
import json
import math
import operator
import re
import sys
from pathlib import Path
from typing import Any

from openai import OpenAI

from lightning_dagster.harnesses import program

SYSTEM_PROMPT = "Use the calculator tool, then reply ANSWER: <number>."
TOOLS: list[dict[str, Any]] = [
    program.tool("calculator", "Evaluate an arithmetic expression.", expression="string")
]
MAX_TURNS = 3  # model calls per episode: tool call, answer, one spare
MAX_TOKENS = 48
ANSWER_RE = re.compile(r"ANSWER:\s*(-?\d+(?:\.\d+)?)")

MAX_EXPRESSION_CHARS = 120  # limits that keep a hostile expression from eating the worker
MAX_EXPONENT = 64
MAX_MAGNITUDE = 1e15
_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """The expression is not plain arithmetic within limits; the message goes back to the model."""


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > MAX_EXPONENT or abs(left) > MAX_MAGNITUDE):
            raise CalculatorError(f"exponent too large (limit {MAX_EXPONENT})")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("result out of range") from None
        # Compare magnitude before isfinite: a big int would overflow the float conversion.
        if isinstance(value, complex) or abs(value) > MAX_MAGNITUDE or not math.isfinite(value):
            raise CalculatorError("result out of range")
        return value
    raise CalculatorError(f"unsupported syntax: {type(node).__name__}")


def calculate(expression: str) -> str:
    """Evaluate `expression` (numbers, + - * / // % **, parentheses) without `eval`; raises CalculatorError."""
    if not isinstance(expression, str) or not expression.strip():
        raise CalculatorError("expression must be a non-empty string")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalculatorError("not an arithmetic expression") from None
    return format_number(_evaluate(tree.body))


def format_number(value: float) -> str:
    """Integers without a trailing `.0`, other values rounded to 6 decimals."""
    if float(value).is_integer():
        return str(int(value))
    return f"{value:.6f}".rstrip("0").rstrip(".")


def run_tool(name: str, arguments: str) -> str:
    """One tool call -> the tool message content; every failure becomes an `error: ...` the model can read."""
    if name != "calculator":
        return f"error: unknown tool {name!r}"
    return program.tool_result(lambda args: calculate(args.get("expression", "")), arguments, CalculatorError)


def extract_answer(content: str | None) -> float | None:
    match = ANSWER_RE.search(content or "")
    return float(match.group(1)) if match else None


def score(answer: float | None, expected: float) -> float:
    return 1.0 if answer is not None and abs(answer - float(expected)) < 1e-6 else 0.0


def run_episode(client: OpenAI, question: str) -> float | None:
    """The tool loop; returns the model's final answer, or None if it never gave one."""
    reply = program.tool_loop(
        client, SYSTEM_PROMPT, question, TOOLS, run_tool, max_turns=MAX_TURNS, max_tokens=MAX_TOKENS
    )
    return extract_answer(reply)


def solve(task: dict[str, Any], client: OpenAI) -> float:
    """One task with a ready client; returns the reward (the example project's `python:` harness)."""
    answer = run_episode(client, task["question"])
    if "answer_path" in task:  # the destination `environment.prepare` made: the answer is posted there
        Path(task["answer_path"]).write_text(json.dumps(answer))
    return score(answer, task["answer"])


def main() -> int:
    return program.main(solve)


if __name__ == "__main__":
    sys.exit(main())
