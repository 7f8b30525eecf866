"""install_checkpointing: one startup warning when checkpointing is on without allowed_roots."""

from __future__ import annotations

import logging

import pytest
from fastapi import FastAPI

from gymckpt.control.settings import CheckpointSettings
from gymckpt.participants.install import install_checkpointing
from gymckpt.participants.model import ModelParticipant

TOKEN = "install-test-token-do-not-log"


def _warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        record
        for record in caplog.records
        if record.levelno == logging.WARNING and record.name in ("gymckpt.control", "gymckpt.participants")
    ]


def test_checkpointing_without_allowed_roots_warns_once_naming_the_setting(caplog) -> None:
    caplog.set_level(logging.DEBUG)
    settings = CheckpointSettings(enabled=True, control_auth_token=TOKEN)
    plane = install_checkpointing(FastAPI(), ModelParticipant(), settings)
    assert plane is not None
    warnings = _warnings(caplog)
    assert len(warnings) == 1, [record.getMessage() for record in warnings]
    message = warnings[0].getMessage()
    assert "checkpoint.allowed_roots" in message
    assert "control token" in message
    assert "any path the process can write" in message
    assert all(TOKEN not in record.getMessage() for record in caplog.records)


def test_no_warning_with_allowed_roots_or_with_checkpointing_off(caplog, tmp_path) -> None:
    caplog.set_level(logging.DEBUG)
    roots = CheckpointSettings(enabled=True, control_auth_token=TOKEN, allowed_roots=[str(tmp_path)])
    assert install_checkpointing(FastAPI(), ModelParticipant(), roots) is not None
    assert install_checkpointing(FastAPI(), ModelParticipant(), CheckpointSettings()) is None
    assert _warnings(caplog) == []
    assert all(TOKEN not in record.getMessage() for record in caplog.records)
