"""The code's own rules that a reader relies on (the README's "How we write code")."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "squareq"
MAX_FUNCTION_LINES = 80


def test_no_function_is_longer_than_80_lines():
    """A function a newcomer can read at once (issue 40: runtime/loader.py's load had grown to 85)."""
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long


def test_the_length_rule_sees_a_long_function(tmp_path):
    """The negative control: a function of 81 lines is counted as 81."""
    source = "def f():\n" + "    x = 1\n" * 80
    node = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef))
    assert node.end_lineno - node.lineno + 1 == MAX_FUNCTION_LINES + 1
