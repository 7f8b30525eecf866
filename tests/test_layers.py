"""The layers: no module of gymckpt imports a layer above its own (the store imports only errors, identity and gc_pause)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "gymckpt"
assert PACKAGE.is_dir(), PACKAGE
#: bottom first; a module may import its own layer and the ones below
LAYERS = [
    ("errors", "_version"),
    # episode identity: what a record's episode_id means, which the store reads too
    ("identity", "gc_pause", "telemetry", "_otel_sdk", "transport"),
    ("store",),
    ("control",),
    # the collection controller: the coordination API and the store, no server
    ("collect",),
    # the test kit: the backend suite (store) and a fake participant (control); demo uses its moto endpoint
    ("testing", "participants"),
    ("workers",),
    ("servers", "integrations"),  # integrations sit beside servers; nothing else imports them
    ("stack",),
    ("demo",),
    ("cli", "__main__"),
]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "gymckpt" else None


def _imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gymckpt"):
            if node.module == "gymckpt":  # from gymckpt import errors
                found.extend(f"gymckpt.{alias.name}" for alias in node.names)
            else:
                found.append(node.module)
        elif isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names if alias.name.startswith("gymckpt."))
    return found


MODULES = sorted(path for path in PACKAGE.rglob("*.py") if path.name != "__init__.py" or path.parent != PACKAGE)


def test_every_top_level_module_has_a_layer() -> None:
    tops = {path.relative_to(PACKAGE).with_suffix("").parts[0] for path in MODULES}
    assert tops <= set(RANK), sorted(tops - set(RANK))


@pytest.mark.parametrize("path", MODULES, ids=lambda path: str(path.relative_to(PACKAGE)))
def test_no_module_imports_a_layer_above_its_own(path: Path) -> None:
    own = path.relative_to(PACKAGE).with_suffix("").parts[0]
    above = [
        module
        for module in _imports(path)
        if (layer := _layer(module)) is not None and RANK.get(layer, len(LAYERS)) > RANK[own]
    ]
    assert above == [], f"{path.relative_to(PACKAGE)} imports {above}, above its layer {own!r}"


def test_the_store_imports_nothing_of_the_others() -> None:
    for path in sorted((PACKAGE / "store").rglob("*.py")):
        others = [
            module
            for module in _imports(path)
            if _layer(module) not in ("store", "identity", "gc_pause", "errors", "_version")
        ]
        assert others == [], f"{path.relative_to(PACKAGE)} imports {others}"


#: the command line's shared modules (errors → one line → exit code, output, options) and its command modules
CLI_SHARED = ("_errors", "_output", "_options")
CLI_COMMANDS = ("verify", "inspect", "serve", "demo", "collect")


def test_the_command_line_is_one_module_per_command_group() -> None:
    """Each command module uses only the shared modules of gymckpt.cli, never another command's;
    the shared ones use no command module; only the group (``_group``) gathers the commands."""
    cli = PACKAGE / "cli"
    modules = {path.stem for path in cli.glob("*.py")}
    assert modules == {"__init__", "_group", *CLI_SHARED, *CLI_COMMANDS}, sorted(modules)
    for name in (*CLI_SHARED, *CLI_COMMANDS):
        used = {module.split(".")[2] for module in _imports(cli / f"{name}.py") if module.startswith("gymckpt.cli.")}
        assert used <= set(CLI_SHARED) - {name}, f"gymckpt/cli/{name}.py imports {sorted(used)}"
    assert {module for module in _imports(cli / "__init__.py")} == {"gymckpt.cli._group"}
