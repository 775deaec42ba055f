"""The agent is a facade over parts that each hold one concern (agent/daemon.py's docstring lists them with
the lock order): no class in the agent's folder grows past MAX_LINES, so a new concern becomes a new part."""

from __future__ import annotations

import ast
from pathlib import Path

AGENT = Path(__file__).resolve().parents[2] / "agent"
MAX_LINES = 300


def test_no_class_in_the_agent_is_over_300_lines() -> None:
    too_long = []
    for path in sorted(AGENT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                lines = node.end_lineno - node.lineno
                if lines > MAX_LINES:
                    too_long.append(f"{path.relative_to(AGENT.parent)}: class {node.name} is {lines} lines")
    assert not too_long, "\n".join(too_long)

