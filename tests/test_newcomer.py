"""Small things a newcomer hit (issue 25, item 6): install hints that work from the clone, a pyproject that
names modules that exist, ``LocalBackend`` importable from the public package, and a stopped stack that
leaves no working directory holding the control token."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import gymckpt
from gymckpt.stack import load_stack

from .support import REPO, kill_group

TOKEN = "newcomer-token-0123456789"
#: the bound of every wait here
WAIT = 60.0
PACKAGE = Path(gymckpt.__file__).resolve().parent


def test_local_backend_is_exported_by_the_store_package(tmp_path: Path) -> None:
    from gymckpt.store import CheckpointStore, LocalBackend, __all__

    assert "LocalBackend" in __all__
    store = CheckpointStore(LocalBackend(str(tmp_path), allow_no_link=True))  # as the README shows it
    manifest = store.write_participant(
        "ck", kind="environment", instance="e0", checkpoint_id="ck", records=[{"episode_id": "a"}]
    )
    assert manifest.record_count == 1


def test_the_readme_names_local_backend_where_it_can_be_imported() -> None:
    readme = (REPO / "README.md").read_text()
    assert "LocalBackend(" in readme
    assert "gymckpt.store._local" not in readme
    for mention in re.finditer(r"LocalBackend\(", readme):
        nearby = readme[mention.start() - 300 : mention.end() + 300]
        assert "gymckpt.store" in nearby, nearby


def test_no_install_hint_names_an_index_gymckpt_is_not_on() -> None:
    """``pip install 'gymckpt[s3]'`` fails: gymckpt is installed from its clone (``pip install -e '.[s3]'``)."""
    extras = set(
        re.findall(r"^([\w-]+) = \[", _section(REPO / "pyproject.toml", "[project.optional-dependencies]"), re.M)
    )
    texts = {REPO / "README.md": (REPO / "README.md").read_text()}
    texts.update({path: path.read_text() for path in sorted(PACKAGE.rglob("*.py"))})
    for path, text in texts.items():
        assert "pip install 'gymckpt[" not in text, f"{path} tells to install gymckpt from an index"
        for extra in re.findall(r"pip install -e '\.\[([\w-]+)\]'", text):
            assert extra in extras, f"{path} names the extra {extra!r}, which pyproject.toml does not have"


def test_pyproject_names_only_modules_that_exist() -> None:
    named = set(re.findall(r"\bgymckpt(?:\.\w+)+", (REPO / "pyproject.toml").read_text()))
    assert named, "pyproject.toml names no module: the check checks nothing"
    for name in sorted(named):
        assert _exists(name), f"pyproject.toml names {name}, which is neither a module nor an attribute of one"


def _exists(name: str) -> bool:
    """Whether ``name`` is a module, or an attribute of one (``gymckpt._version.__version__``)."""
    try:
        if importlib.util.find_spec(name) is not None:
            return True
    except ModuleNotFoundError:
        pass
    module, _, attribute = name.rpartition(".")
    try:
        return hasattr(importlib.import_module(module), attribute)
    except ModuleNotFoundError:
        return False


def _section(path: Path, heading: str) -> str:
    text = path.read_text()
    start = text.index(heading) + len(heading)
    end = text.find("\n[", start)
    return text[start : end if end >= 0 else len(text)]


# --- a stack's working directory holds the token: gone when the stack stops


def _stack_file(tmp_path: Path) -> Path:
    spec = tmp_path / "stack.yaml"
    spec.write_text(
        f"checkpoint: {{enabled: true, control_auth_token: {TOKEN}, allowed_roots: [./ckpts]}}\n"
        "servers:\n  - {name: counter, kind: counter}\n"
    )
    return spec


def _workdirs(temporary: Path) -> list[Path]:
    return sorted(temporary.glob("gymckpt-stack-*"))


def _read_until(process: subprocess.Popen[bytes], text: bytes, timeout: float) -> bytes:
    """What ``process`` wrote on stdout until a line holding ``text`` (bounded by ``timeout``)."""
    assert process.stdout is not None
    seen = b""
    deadline = time.monotonic() + timeout
    while text not in seen:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"no {text!r} within {timeout} s: {seen!r}"
        ready, _, _ = select.select([process.stdout], [], [], remaining)
        if ready:
            chunk = os.read(process.stdout.fileno(), 65536)
            assert chunk, f"stack up exited ({process.poll()}) before {text!r}: {seen!r}"
            seen += chunk
    return seen


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_stopped_stack_leaves_no_workdir_holding_the_token(stop: signal.Signals, tmp_path: Path) -> None:
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    environment = {key: value for key, value in os.environ.items() if not key.startswith("GYMCKPT_")}
    process = subprocess.Popen(
        [sys.executable, "-m", "gymckpt", "stack", "up", str(_stack_file(tmp_path))],
        cwd=tmp_path,
        env={**environment, "PYTHONPATH": str(REPO), "TMPDIR": str(temporary), "PYTHONUNBUFFERED": "1"},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        _read_until(process, b"press Ctrl-C", WAIT)
        (workdir,) = _workdirs(temporary)  # while it runs: the configs (with the token) and the logs
        assert TOKEN in (workdir / "counter.yaml").read_text()
        os.kill(process.pid, stop)  # what Ctrl-C sends the foreground process (the servers are in groups of their own)
        _, stderr = process.communicate(timeout=WAIT)
    finally:
        kill_group(process, WAIT)
    assert process.returncode == 0, stderr
    assert _workdirs(temporary) == [], "the stack's workdir (with the control token) outlived the stack"
    assert f"{workdir}" in stderr.decode() and b"were removed" in stderr, stderr
    assert b"Traceback" not in stderr, stderr


def test_a_stack_keeps_its_workdir_only_when_asked_or_given(tmp_path: Path) -> None:
    spec = _stack_file(tmp_path)
    with load_stack(spec) as stack:
        made = stack.workdir
        assert made.is_dir() and made.name.startswith("gymckpt-stack-")
    assert not made.exists()
    with load_stack(spec, keep_workdir=True) as stack:
        kept = stack.workdir
    try:
        assert kept.is_dir()
    finally:
        shutil.rmtree(kept)
    given = tmp_path / "mine"
    with load_stack(spec, workdir=given):
        pass
    assert given.is_dir()  # the caller's directory stays
