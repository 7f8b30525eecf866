"""Settings mistakes are caught at startup (issue 25, item 2): a key that looks like a known one is refused
with a did-you-mean naming the file and the key, and a settings error is one ``file: key.path: why`` line
per problem, without pydantic's boilerplate, the values given or the token."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

import pytest
import yaml

from gymckpt.control.settings import load_settings, looks_like
from gymckpt.errors import SettingsError
from gymckpt.stack import load_stack
from gymckpt.stack.kinds import load_config

from ..support import REPO

TOKEN = "typo-test-token-0123456789"
#: what pydantic appends to each error, and must never reach a user
BOILERPLATE = ("errors.pydantic.dev", "For further information", "input_value", "[type=")
#: top-level spellings of ``checkpoint`` that must not turn checkpointing silently off
CHECKPOINT_TYPOS = ["chekpoint", "Checkpoint", "CHECKPOINT", "checkpoints", "check_point", "chekcpoint"]
#: the waits of the processes started here
WAIT = 60


@pytest.fixture(autouse=True)
def no_gymckpt_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Tests start without any GYMCKPT_ variable of the machine they run on, and with a temporary directory
    of their own (where a stack would make its workdir: other tests' stacks come and go in the system's)."""
    for name in list(os.environ):
        if name.upper().startswith("GYMCKPT_"):
            monkeypatch.delenv(name)
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setenv("TMPDIR", str(temporary))  # this test's subprocesses
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))  # and this process


def block_yaml(key: str = "checkpoint") -> str:
    return f"{key}:\n  enabled: true\n  control_auth_token: {TOKEN}\n  allowed_roots: [./checkpoints]\n"


def refused(call: Any, *args: Any) -> str:
    """The text of the SettingsError ``call(*args)`` raises, checked free of boilerplate and the token."""
    with pytest.raises(SettingsError) as caught:
        call(*args)
    text = str(caught.value)
    # what an uncaught one would print too: pydantic's error is not chained to it
    printed = "".join(traceback.format_exception(caught.value))
    for shown in (text, repr(caught.value), printed):
        assert TOKEN not in shown, shown
        for noise in BOILERPLATE:
            assert noise not in shown, shown
    return text


def stack_workdirs() -> list[str]:
    """The stack workdirs in this test's temporary directory."""
    return sorted(glob.glob(os.path.join(tempfile.gettempdir(), "gymckpt-stack-*")))


# --- the top-level checkpoint key, misspelled


@pytest.mark.parametrize("key", CHECKPOINT_TYPOS)
def test_a_server_config_with_a_misspelled_checkpoint_key_fails_naming_the_file_and_the_key(
    key: str, tmp_path: Path
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("instance: counter-0\n" + block_yaml(key))
    text = refused(load_config, "counter", bad)
    assert text == f"{bad}: {key}: unknown key; did you mean 'checkpoint'?"


@pytest.mark.parametrize("key", CHECKPOINT_TYPOS)
def test_a_stack_file_with_a_misspelled_checkpoint_key_fails_before_any_socket_or_workdir(
    key: str, tmp_path: Path
) -> None:
    bad = tmp_path / "stack.yaml"
    bad.write_text("host: 127.0.0.1\n" + block_yaml(key) + "servers:\n  - {name: counter, kind: counter}\n")
    text = refused(load_stack, bad)
    assert text == f"{bad}: {key}: unknown key; did you mean 'checkpoint'?"
    assert stack_workdirs() == []  # nothing made, so nothing holding the token is left


@pytest.mark.parametrize("key", CHECKPOINT_TYPOS)
def test_your_own_servers_settings_refuse_a_misspelled_checkpoint_key(key: str, tmp_path: Path) -> None:
    bad = tmp_path / "settings.yaml"
    bad.write_text("server: {name: mine}\n" + block_yaml(key))
    assert refused(load_settings, bad) == f"{bad}: {key}: unknown key; did you mean 'checkpoint'?"
    assert refused(load_settings, {key: {"enabled": False}}) == f"{key}: unknown key; did you mean 'checkpoint'?"


def test_unknown_keys_that_look_like_no_known_key_stay_allowed_where_they_were(tmp_path: Path) -> None:
    settings = tmp_path / "settings.yaml"
    settings.write_text("server: {name: mine}\nmodel_name: m\ncheckpoint_every: 3\n" + block_yaml())
    assert load_settings(settings).checkpoint.enabled is True  # a user's own keys beside the block
    stack = tmp_path / "stack.yaml"
    stack.write_text("x-defaults: {workers: 1}\nservers:\n  - {name: counter, kind: counter}\n")
    with load_stack(stack, workdir=tmp_path / "work") as loaded:
        assert list(loaded.servers) == ["counter"]


# --- keys close to any known key, at every level


@pytest.mark.parametrize(
    ("kind", "config", "expected"),
    [
        ("counter", {"instanse": "c"}, "instanse: unknown key; did you mean 'instance'?"),
        ("agent", {"modl_url": "http://x"}, "modl_url: unknown key; did you mean 'model_url'?"),
        ("counter", {"checkpoint": {"enabeld": True}}, "checkpoint.enabeld: unknown key; did you mean 'enabled'?"),
        (
            "counter",
            {"checkpoint": {"alowed_roots": ["/x"]}},
            "checkpoint.alowed_roots: unknown key; did you mean 'allowed_roots'?",
        ),
    ],
)
def test_a_server_configs_key_close_to_a_field_gets_a_did_you_mean(
    kind: str, config: dict[str, Any], expected: str, tmp_path: Path
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(config))
    lines = refused(load_config, kind, bad).splitlines()
    assert f"{bad}: {expected}" in lines
    assert not any(line.endswith("model_url: required, and not given") for line in lines)  # said once, as the typo


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("server:\n  - {name: c, kind: counter}\n", "server: unknown key; did you mean 'servers'?"),
        ("servers:\n  - {name: c, kind: counter, prot: 8000}\n", "servers[0].prot: unknown key; did you mean 'port'?"),
        (
            "servers:\n  - {name: c, kind: countr}\n",
            "servers[0].kind: 'countr' is no server kind; did you mean 'counter'?",
        ),
        (
            "servers:\n  - {name: c, kind: counter, config: {instanse: x}}\n",
            "servers[0].config.instanse: unknown key; did you mean 'instance'?",
        ),
        (
            "servers:\n  - {name: inference, kind: inference}\n"
            '  - {name: m, kind: model, config: {inference_url: "{inferense}"}}\n',
            "servers[1].config.inference_url: '{inferense}' names no server of this stack; did you mean '{inference}'?",
        ),
    ],
    ids=["servers", "entry-port", "kind", "entry-config", "reference"],
)
def test_a_stack_files_key_close_to_a_known_one_gets_a_did_you_mean(text: str, expected: str, tmp_path: Path) -> None:
    bad = tmp_path / "stack.yaml"
    bad.write_text(text)
    assert refused(load_stack, bad).startswith(f"{bad}: {expected}")
    assert stack_workdirs() == []


def test_looks_like_misspellings_but_not_other_words() -> None:
    for key, known in [
        ("chekpoint", "checkpoint"),
        ("Checkpoint", "checkpoint"),
        ("checkpoints", "checkpoint"),
        ("check_point", "checkpoint"),
        ("check-point", "checkpoint"),
        ("chkpoint", "checkpoint"),
        ("chekcpoint", "checkpoint"),
        ("hots", "host"),
        ("post", "host"),
    ]:
        assert looks_like(key, known), (key, known)
    for key, known in [
        ("checkpoint", "checkpoint"),
        ("checkpoint_dir", "checkpoint"),
        ("checkpoint_every", "checkpoint"),
        ("port", "host"),
        ("server", "checkpoint"),
        ("x-defaults", "workers"),
    ]:
        assert not looks_like(key, known), (key, known)


# --- settings errors: file, key, why; nothing else


def test_a_settings_error_is_one_line_per_problem_naming_the_file_and_the_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        f"checkpoint:\n  enabled: true\n  control_auth_token: {TOKEN}\n  lease_grace_seconds: soon\n"
        "  allowed_roots: []\ndata_connector_limit: -1\n"
    )
    lines = refused(load_config, "counter", bad).splitlines()
    assert lines == [
        f"{bad}: checkpoint.lease_grace_seconds: Input should be a valid number, unable to parse string as a number",
        f"{bad}: checkpoint.allowed_roots: checkpoint.allowed_roots must list at least one root, or be left out",
        f"{bad}: data_connector_limit: Input should be greater than or equal to 0",
    ]
    assert isinstance(SettingsError([]), ValueError)  # what callers catch today still catches it


def test_a_settings_error_names_the_variable_a_bad_value_came_from(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GYMCKPT_CHECKPOINT__LEASE_GRACE_SECONDS", "soon")
    text = refused(load_settings, {"checkpoint": {}})
    assert text.startswith("checkpoint.lease_grace_seconds (from GYMCKPT_CHECKPOINT__LEASE_GRACE_SECONDS): ")


def test_invalid_yaml_is_a_settings_error_naming_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("checkpoint: [unclosed\n")
    assert refused(load_config, "counter", bad).startswith(f"{bad}: invalid YAML at line 2, column 1")


# --- the command line: one line, no traceback


def gymckpt(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    environment = {key: value for key, value in os.environ.items() if not key.startswith("GYMCKPT_")}
    environment["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [sys.executable, "-m", "gymckpt", *args],
        cwd=cwd,
        env=environment,
        capture_output=True,
        text=True,
        timeout=WAIT,
        check=False,
    )


def assert_one_line_refusal(result: subprocess.CompletedProcess[str], *expected: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    output = result.stdout + result.stderr
    assert "Traceback" not in output, output
    assert TOKEN not in output, output
    for noise in BOILERPLATE:
        assert noise not in output, output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    for text in expected:
        assert text in lines[0], (text, lines[0])


def test_gymckpt_serve_refuses_a_misspelled_checkpoint_key_in_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(block_yaml("chekpoint"))
    result = gymckpt("serve", "counter", "--port", "0", "--config", str(bad), cwd=tmp_path)
    assert_one_line_refusal(result, f"{bad}: chekpoint: unknown key; did you mean 'checkpoint'?")


def test_gymckpt_stack_up_refuses_a_misspelled_key_in_one_line_leaving_no_workdir(tmp_path: Path) -> None:
    entry = "servers:\n  - {name: counter, kind: counter}\n"
    for text, expected in [
        (block_yaml("Checkpoint") + entry, "Checkpoint: unknown key; did you mean 'checkpoint'?"),
        (  # refused once the sockets are open and the workdir made: both gone again
            block_yaml() + "servers:\n  - {name: counter, kind: counter, config: {instanse: c}}\n",
            "servers[0].config.instanse: unknown key; did you mean 'instance'?",
        ),
    ]:
        bad = tmp_path / "stack.yaml"
        bad.write_text(text)
        result = gymckpt("stack", "up", str(bad), cwd=tmp_path)
        assert_one_line_refusal(result, f"{bad}: {expected}")
        assert stack_workdirs() == []
