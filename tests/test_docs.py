"""Every code block of README.md and docs/*.md runs as written.

In one fresh workspace per document (tests/docs_support.py), in the document's order, as a
reader following it would:

- a ``python`` block runs as a script (``python -c``) with the workspace as its working
  directory and must exit 0; a block whose first line is ``# NAME.py`` is a file the text
  asks you to save: it is written to the workspace, and the shell lines that run it
  (``python NAME.py …``) run it;
- a ``sh`` block runs line by line: servers (``gymckpt stack up``, ``uvicorn``) are started,
  or stopped and started again when the text starts them again; ``gymckpt verify`` /
  ``gymckpt inspect`` and ``python NAME.py`` lines must exit 0. The ``s3://`` lines run
  against an S3 endpoint (moto) this test serves, holding the checkpoint they name;
- a ``yaml`` block must parse, and its ``checkpoint:`` block must be valid settings;
- the shell blocks of the README's embedding section are run (and their replies checked)
  by tests/test_examples.py, and every block of its NeMo Gym section (which needs Python
  3.12 and NeMo Gym) by tests/integrations/test_nemo_doc.py;
- a block that cannot run carries ``<!-- not run: reason -->`` on the line before it; the
  marks are counted, so one more needs this test changed too.

Documented ports are replaced by free ones; nothing else of a line is changed.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from .docs_support import EMBEDDING_SECTION, NEMO_GYM_SECTION, README, REPO, Block, Workspace, code_blocks

pytestmark = pytest.mark.timeout(420)

DOCUMENTS = [README, *sorted((REPO / "docs").glob("*.md"))]
#: (document, reason) of every block marked not run: the demo and the test suite themselves, a Slurm batch script
NOT_RUN = 3
_FILE_BLOCK = re.compile(r"^# (?P<name>[A-Za-z0-9_.-]+\.py)\b")
#: "S3" is the storage service; any other letter-and-digits id would name a section of a spec the repo lacks
_SPEC_ID = re.compile(r"\b(?!S3\b)[A-Z][0-9]{1,2}\b|\bSPEC\b|§")


def _python(block: Block, ws: Workspace) -> None:
    named = _FILE_BLOCK.match(block.text)
    if named:
        (ws.root / named["name"]).write_text(ws.sub(block.text))
        return
    done = subprocess.run(
        [sys.executable, "-c", ws.sub(block.text)],
        cwd=ws.root,
        env=ws.env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, f"{block.where}: the python block failed\n{done.stdout[-3000:]}\n{done.stderr[-4000:]}"


def _yaml(block: Block) -> None:
    from gymckpt.control.settings import load_settings

    data = yaml.safe_load(block.text)
    assert isinstance(data, dict), f"{block.where}: not a mapping"
    if "checkpoint" in data:
        assert load_settings(data).checkpoint is not None


def _serve_s3_checkpoint(ws: Workspace) -> Any:  # a MotoEndpoint: moto is imported only when needed
    """An S3 endpoint holding s3://bucket/run-3/step-700 (the checkpoint the README's s3 lines name)."""
    from gymckpt.store import open_store
    from gymckpt.testing.moto import DUMMY_KEY, DUMMY_SECRET, MotoEndpoint

    endpoint = MotoEndpoint().start()
    try:
        endpoint.create_bucket("bucket")
        store = open_store("s3://bucket/run-3", **endpoint.storage_options())
        try:
            manifest = store.write_participant(
                "step-700",
                kind="environment",
                instance="env-0",
                checkpoint_id="step-700",
                records=[{"episode_id": "3-0", "boundary": {"turn": 1}}],
            )
            store.publish("step-700", [manifest])
        finally:
            store.close()
    except BaseException:
        endpoint.stop()
        raise
    ws.ports["9000"] = str(endpoint.port)
    ws.env.update(AWS_ACCESS_KEY_ID=DUMMY_KEY, AWS_SECRET_ACCESS_KEY=DUMMY_SECRET, AWS_DEFAULT_REGION=endpoint.region)
    return endpoint


def run_document(path: Path, ws: Workspace) -> dict[str, int]:
    """Run every block of ``path`` in order; count what was run, delegated and marked."""
    counts = {"python": 0, "sh": 0, "yaml": 0, "delegated": 0, "nemo_gym": 0, "not_run": 0}
    endpoint = None
    try:
        for block in code_blocks(path):
            if block.not_run:
                counts["not_run"] += 1
            elif path == README and block.section == NEMO_GYM_SECTION:
                counts["nemo_gym"] += 1  # tests/integrations/test_nemo_doc.py runs these with NeMo Gym
            elif block.lang == "python":
                _python(block, ws)
                counts["python"] += 1
            elif block.lang == "sh" and path == README and block.section == EMBEDDING_SECTION:
                counts["delegated"] += 1  # tests/test_examples.py runs these and checks every reply
            elif block.lang == "sh":
                if endpoint is None and "s3://" in block.text:
                    endpoint = _serve_s3_checkpoint(ws)
                ws.run_block(block)
                counts["sh"] += 1
            elif block.lang == "yaml":
                _yaml(block)
                counts["yaml"] += 1
            else:
                assert block.lang == "", f"{block.where}: a ```{block.lang} block: write it as python, sh or yaml"
        return counts
    except Exception as exc:
        raise AssertionError(f"{exc}{ws.server_logs()}") from exc
    finally:
        ws.close()
        if endpoint is not None:
            endpoint.stop()


def test_every_block_of_the_readme_runs_as_written(tmp_path: Path) -> None:
    ws = Workspace(tmp_path)
    counts = run_document(README, ws)
    assert counts["python"] >= 3 and counts["sh"] >= 4 and counts["yaml"] >= 1, counts
    assert counts["delegated"] >= 5 and counts["nemo_gym"] >= 5, counts
    outputs = {result.line.strip(): result.output for result in ws.results}
    assert re.search(
        r"step-700: \d+ rollouts finished, \d+ continue from the checkpoint", outputs["python trainer.py checkpoint"]
    )
    assert "mean reward 1.00" in outputs["python trainer.py restore"], outputs["python trainer.py restore"]
    assert "0 error(s)" in outputs["gymckpt verify ./checkpoints/step-700"]
    assert (tmp_path / "checkpoints" / "step-700" / "gym" / "checkpoint.json").is_file()
    assert (tmp_path / "env.jsonl").read_text().startswith('{"episode_id":"4-0"')


@pytest.mark.parametrize("path", DOCUMENTS[1:], ids=lambda path: path.name)
def test_every_block_of_the_docs_runs_as_written(path: Path, tmp_path: Path) -> None:
    run_document(path, Workspace(tmp_path))


def test_only_what_cannot_run_is_marked_not_run() -> None:
    marked = [(block.where, block.not_run) for path in DOCUMENTS for block in code_blocks(path) if block.not_run]
    assert len(marked) == NOT_RUN, marked
    assert all(reason and len(reason) > 10 for _, reason in marked), marked


def test_the_docs_stand_alone() -> None:
    """No ids of a specification the repository does not hold; every relative link and anchor resolves."""
    for path in DOCUMENTS:
        text = path.read_text()
        found = [
            (number, match[0]) for number, line in enumerate(text.splitlines(), 1) for match in _SPEC_ID.finditer(line)
        ]
        assert not found, f"{path.name}: {found}"
        headings = {_slug(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://")):
                continue
            file, _, anchor = target.partition("#")
            if file:
                assert (path.parent / file).exists(), f"{path.name}: link to {target} names no file"
            elif anchor:
                assert anchor in headings, f"{path.name}: link to #{anchor} names no heading"


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_s3_is_installed_by_name_where_the_readme_introduces_it() -> None:
    text = README.read_text()
    section = text[text.index("## Object storage (S3)") :]
    section = section[: section.index("\n## ", 1)]
    assert "pip install -e '.[s3]'" in section  # gymckpt is on no index: installed from the clone
    assert "pip install -e '.[demo-s3]'" in section
