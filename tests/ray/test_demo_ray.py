"""``gymckpt demo --ray``: three Ray nodes on this machine, the one holding the environment and agent killed.

The demo makes its own cluster (in a network namespace of its own) and its own S3 server: this
module needs no cluster fixture. Its table is what is asserted: each server's node before and
after the loss, and no rollout lost or different.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from gymckpt.testing.raycluster import install_hint, missing
from tests.ray.conftest import PROJECT, _unavailable

SERVERS = ("inference", "model", "resources", "agent", "environment")


def _table_rows(text: str) -> dict[str, list[str]]:
    """The table's rows by their first cell (cells: runs of two or more spaces apart)."""
    rows = {}
    for line in text.splitlines():
        cells = [cell for cell in re.split(r"\s{2,}", line.strip()) if cell]
        if len(cells) >= 2:
            rows.setdefault(cells[0], cells[1:])
    return rows


@pytest.mark.slow
def test_demo_ray_recovers_every_rollout_on_the_nodes_left() -> None:
    lacking = missing()
    if lacking:
        _unavailable(install_hint(lacking))
    done = subprocess.run(
        [sys.executable, "-m", "gymckpt", "demo", "--ray", "--rollouts", "16"],
        cwd=PROJECT,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "COLUMNS": "120"},
    )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-4000:]}"
    rows = _table_rows(done.stdout)
    placed = {name: rows[name] for name in SERVERS}
    before = {name: cells[0].removesuffix(" (lost)") for name, cells in placed.items()}
    after = {name: cells[1] for name, cells in placed.items()}
    killed = rows["killed"][0].split()[0]
    assert killed == "node1" and before["environment"] == before["agent"] == killed, placed
    # spread over at least two nodes before; none on the killed node after
    assert len(set(before.values())) >= 2, before
    assert set(after.values()) <= {"head", "node2"}, after
    assert {name for name, cells in placed.items() if cells[0].endswith("(lost)")} == {
        name for name, node in before.items() if node == killed
    }
    assert rows["rollouts"] == ["16"] and rows["lost"] == ["0"] and rows["differing"] == ["0"]
    exported = int(rows["exported"][0])
    assert exported >= 1 and rows["continued"] == rows["exported"]
    # the realistic state (prompts, tool outputs, ledgers with logprobs) went through the loss: a rollout on
    # its first turn carries ~3.9 KB (environment ~1.1, agent ~1.1, model ~1.6), the compact state ~0.3 KB;
    # 2 KB on average leaves room for rollouts exported before their first model call
    assert int(rows["records bytes"][0].replace(",", "")) >= 2_000 * exported, rows["records bytes"]
    assert 0 <= int(rows["exported past their first turn"][0]) <= exported
    assert "ok: every rollout has its result" in done.stdout


def test_demo_ray_without_what_it_needs_is_one_line_and_status_2(tmp_path: object) -> None:
    """No ``ip`` nor ``unshare`` on the PATH: refused in one line naming them, exit status 2."""
    done = subprocess.run(
        [sys.executable, "-m", "gymckpt", "demo", "--ray", "--rollouts", "4"],
        cwd=PROJECT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PATH": str(tmp_path)},
    )
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: gymckpt demo --ray needs "), done.stderr
    assert "ip (iproute2)" in lines[0] and "unshare (util-linux)" in lines[0]
