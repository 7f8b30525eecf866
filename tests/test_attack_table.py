"""The attack table itself: every row names its promise, and every live row's test exists."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from gymckpt.testing.attacks import ATTACKS, LIVE_ATTACKS

ROOT = Path(__file__).resolve().parents[1]


def test_the_table_has_at_least_sixty_rows_each_naming_its_promise() -> None:
    rows = [*ATTACKS.values(), *LIVE_ATTACKS.values()]
    assert len(rows) >= 60
    assert len(set(ATTACKS) | set(LIVE_ATTACKS)) == len(rows), "a row name is used twice"
    assert all(len(row.promise) > 20 for row in rows), [name for name, row in ATTACKS.items() if not row.promise]


def _test_functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test_")
    }


@pytest.mark.parametrize("name", sorted(LIVE_ATTACKS))
def test_every_live_row_names_a_test_that_exists(name: str) -> None:
    path, _, function = LIVE_ATTACKS[name].test.partition("::")
    assert path.startswith("tests/") and function, LIVE_ATTACKS[name].test
    assert function in _test_functions(ROOT / path), f"{name}: {LIVE_ATTACKS[name].test} is not a test"
