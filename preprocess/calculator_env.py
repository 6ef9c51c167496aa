"""The calculator environment of the agent example (params/agent-gsm8k.yaml): each GRPO rollout
gets its own instance (grpo.environment_factory, TRL's environment_factory=), whose one public
method is the tool the model calls; the prompts offer it with the schema of
data/source/gsm8k-tools/tools.json, read off the method's signature and docstring.

The tool evaluates plain arithmetic only (numbers, + - * /, parentheses), parsed with `ast`,
never `eval`: the expression is model-written. A result is written as GSM8K writes one (an
integer without a decimal point, else at most 6 decimals without trailing zeros), so the
answer the model copies from it compares equal to the reference. A malformed expression raises,
and the rollout's loop answers the model with the error text (counted in
tools/failure_frequency); the instance counts its calls and failures (`calls`, `failures`)
for a reward function that wants them (`environments=`).
"""

from __future__ import annotations

import ast
import operator

OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
             ast.Div: operator.truediv}


def _value(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _value(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](_value(node.left), _value(node.right))
    raise ValueError(f"not plain arithmetic: {ast.unparse(node)}")


def evaluate(expression: str) -> str:
    """`expression` computed and written as GSM8K writes a number."""
    value = _value(ast.parse(expression.strip(), mode="eval").body)
    if float(value).is_integer():
        return str(int(value))
    return f"{value:.6f}".rstrip("0").rstrip(".")


class Calculator:
    """One rollout's calculator (TRL's environment contract: reset, then the tools)."""

    def __init__(self):
        self.calls = self.failures = 0

    def reset(self, **row) -> None:
        """A new rollout: nothing to show the model beyond its prompt."""
        self.calls = self.failures = 0

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression (numbers, + - * /, parentheses).

        Args:
            expression: e.g. 48/2 or (3+4)*2
        """
        self.calls += 1
        try:
            return evaluate(expression)
        except Exception:
            self.failures += 1
            raise
