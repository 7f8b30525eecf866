"""The NeMo Gym integration is optional: the rest of gymckpt never imports it, and only it imports nemo_gym."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "gymckpt"
INTEGRATIONS = PACKAGE / "integrations"


def _imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_nothing_outside_the_integrations_imports_them_or_nemo_gym() -> None:
    for path in sorted(PACKAGE.rglob("*.py")):
        if INTEGRATIONS in path.parents:
            continue
        found = {name for name in _imported(path) if name.startswith(("gymckpt.integrations", "nemo_gym"))}
        assert not found, f"{path.relative_to(PACKAGE)} imports {sorted(found)}"


def test_the_integration_package_imports_without_nemo_gym() -> None:
    """``import gymckpt.integrations.nemo_gym`` works on Python 3.11 without NeMo Gym; serving says what to install."""
    import pytest

    import gymckpt.integrations.nemo_gym as integration

    try:
        import nemo_gym  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install nemo-gym"):
            integration.app()
