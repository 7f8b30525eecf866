"""The README's NeMo Gym section runs as written, with the Python 3.12 virtualenv it builds.

Its blocks (which tests/test_docs.py leaves to this test) run in order in a fresh directory: the YAML and Python files it asks you to save
are written, ``gymckpt stack up`` is started (and, where the section starts it again, stopped
as Ctrl-C stops it first), and the ``python``/``gymckpt verify`` lines must exit 0. The two
setup lines (``.ci/nemo-gym-venv``, ``source .venv-nemo/bin/activate``) are what this test's
interpreter already is. The section's ports are replaced by free ones.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from typing import TYPE_CHECKING

from gymckpt.testing.net import free_ports
from tests.docs_support import NEMO_GYM_SECTION, README, code_blocks
from tests.support import signal_group

from .nemo_support import nemo_python

if TYPE_CHECKING:
    from pathlib import Path

PORTS = ("8100", "8101", "8102", "8103")
SETUP_LINES = {".ci/nemo-gym-venv", "source .venv-nemo/bin/activate"}
START_SECONDS = 180.0
_FILE = re.compile(r"^# (?P<name>[A-Za-z0-9_.-]+\.(?:py|yaml))\b")


def blocks() -> list[tuple[str, str]]:
    """The README section's blocks, in order: (language, text)."""
    found = [(block.lang, block.text) for block in code_blocks(README) if block.section == NEMO_GYM_SECTION]
    assert found, f"README.md has no section {NEMO_GYM_SECTION!r} with code blocks"
    return found


def _tail(path: str) -> str:
    """The end of a stack's log, for a failure's message."""
    with open(path, "rb") as log:
        return log.read()[-4000:].decode(errors="replace")


def _answers(port: str) -> bool:
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
            f"http://127.0.0.1:{port}/health", timeout=5
        ):
            return True
    except urllib.error.HTTPError:
        return True  # a NeMo Gym server has no /health: any reply means it serves
    except OSError:
        return False


def test_the_readme_nemo_gym_section_runs_as_written(tmp_path: Path) -> None:
    python = nemo_python()
    ports = dict(zip(PORTS, map(str, free_ports(len(PORTS))), strict=True))

    def sub(text: str) -> str:
        return re.sub(r"\b(" + "|".join(PORTS) + r")\b", lambda match: ports[match[1]], text)

    env = {key: value for key, value in os.environ.items() if not key.startswith("GYMCKPT_")}
    env["PATH"] = f"{python.parent}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(python.parent.parent)
    env.pop("PYTHONPATH", None)
    stack: subprocess.Popen[bytes] | None = None
    outputs: dict[str, str] = {}

    def stop() -> None:
        if stack is not None and stack.poll() is None:
            signal_group(stack.pid, signal.SIGINT)  # Ctrl-C: the stack stops every server
            try:
                stack.wait(timeout=60)
            except subprocess.TimeoutExpired:
                signal_group(stack.pid, signal.SIGKILL)
                stack.wait(timeout=60)

    try:
        for lang, text in blocks():
            named = _FILE.match(text)
            if lang in ("yaml", "python") and named:
                (tmp_path / named["name"]).write_text(sub(text))
                continue
            assert lang == "sh", f"a ```{lang} block the section does not ask to save"
            for line in filter(None, (line.strip() for line in text.splitlines())):
                if line in SETUP_LINES:
                    continue
                if line.startswith("gymckpt stack up"):
                    stop()
                    log = (tmp_path / f"stack-{len(outputs)}.log").open("wb")
                    stack = subprocess.Popen(
                        ["bash", "-c", "exec " + line],
                        cwd=tmp_path,
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                    outputs[line] = ""
                    deadline = time.monotonic() + START_SECONDS
                    for port in ports.values():
                        while not _answers(port):
                            assert stack.poll() is None, f"{line} exited:\n{_tail(log.name)}"
                            assert time.monotonic() < deadline, f"{line}: port {port} did not answer\n{_tail(log.name)}"
                            time.sleep(0.2)
                    continue
                assert line.split()[0] in ("python", "gymckpt"), f"{line!r}: a line this test does not run"
                done = subprocess.run(
                    ["bash", "-c", line],
                    cwd=tmp_path,
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=600,
                    check=False,
                )
                assert done.returncode == 0, (
                    f"{line}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
                )
                outputs[line] = done.stdout
    finally:
        stop()
    checkpointed = outputs["python nemo_trainer.py checkpoint"]
    assert re.search(r"nemo-1: 8 rollouts checkpointed mid-conversation", checkpointed), checkpointed
    assert "0 error(s)" in outputs["gymckpt verify ./checkpoints/nemo-1"], outputs
    restored = outputs["python nemo_trainer.py restore"]
    found = re.search(r"restored 8 attempts; (\d+) model calls after the restore, (\d+) asked again", restored)
    assert found and int(found[1]) > 0 and int(found[2]) <= 8, restored
    assert len(re.findall(r"task-\d-a1: 3 tool calls, counted \d+, reward [01]\.0", restored)) == 8, restored
