"""The ``checkpoint:`` settings block (SPEC C12): files, dicts, defaults, validation, environment."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic import SecretStr

from gymckpt.control.settings import CheckpointSettings, GymckptSettings, load_settings
from gymckpt.errors import SettingsError

TOKEN = "tok-0123456789abcdefXYZ"


@pytest.fixture(autouse=True)
def no_gymckpt_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests start without any GYMCKPT_ variable of the machine they run on."""
    for name in list(os.environ):
        if name.upper().startswith("GYMCKPT_"):
            monkeypatch.delenv(name)


def write_yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "settings.yaml"
    path.write_text(text)
    return path


def test_defaults_without_a_block():
    for settings in (load_settings(), load_settings({}), load_settings({"checkpoint": {}})):
        block = settings.checkpoint
        assert block.enabled is False
        assert block.control_auth_token is None
        assert block.token == ""
        assert block.lease_grace_seconds == 600.0
        assert block.storage_options == {}
        assert block.allowed_roots is None
        assert block.control_connector_limit == 0
        assert block.control_connector_limit_per_host == 0


def test_an_empty_yaml_file_gives_the_defaults(tmp_path):
    settings = load_settings(write_yaml(tmp_path, ""))
    assert settings.checkpoint.enabled is False
    assert settings.checkpoint.lease_grace_seconds == 600.0


def test_load_from_a_yaml_file(tmp_path):
    path = write_yaml(
        tmp_path,
        f"""
server:
  name: other settings are not this block's
checkpoint:
  enabled: true
  control_auth_token: {TOKEN}
  lease_grace_seconds: 45
  storage_options:
    endpoint_url: http://127.0.0.1:9000
    key: abc
  allowed_roots:
    - /data/ckpt
    - s3://bucket/run
  control_connector_limit: 8
  control_connector_limit_per_host: 2
""",
    )
    for source in (path, str(path)):
        block = load_settings(source).checkpoint
        assert block.enabled is True
        assert isinstance(block.control_auth_token, SecretStr)
        assert block.token == TOKEN
        assert block.lease_grace_seconds == 45.0
        assert block.storage_options == {"endpoint_url": "http://127.0.0.1:9000", "key": "abc"}
        assert block.allowed_roots == ["/data/ckpt", "s3://bucket/run"]
        assert block.control_connector_limit == 8
        assert block.control_connector_limit_per_host == 2


def test_load_from_a_dict():
    block = load_settings(
        {"checkpoint": {"enabled": True, "control_auth_token": TOKEN, "lease_grace_seconds": 5}}
    ).checkpoint
    assert block.enabled is True
    assert block.token == TOKEN
    assert block.lease_grace_seconds == 5.0


def test_a_yaml_file_that_is_not_a_mapping_is_refused(tmp_path):
    with pytest.raises(ValueError, match="checkpoint"):
        load_settings(write_yaml(tmp_path, "- a\n- b\n"))


@pytest.mark.parametrize("token", [None, ""])
def test_enabled_without_a_token_fails_at_startup_naming_control_auth_token(token, tmp_path):
    block = {"enabled": True} if token is None else {"enabled": True, "control_auth_token": token}
    with pytest.raises(SettingsError, match="control_auth_token"):
        load_settings({"checkpoint": block})
    text = "checkpoint:\n  enabled: true\n" + ("" if token is None else '  control_auth_token: ""\n')
    with pytest.raises(SettingsError, match="control_auth_token"):
        load_settings(write_yaml(tmp_path, text))


def test_disabled_without_a_token_is_fine():
    assert load_settings({"checkpoint": {"enabled": False}}).checkpoint.token == ""


@pytest.mark.parametrize("field", ["control_connector_limit", "control_connector_limit_per_host"])
def test_negative_connector_limits_are_refused(field):
    with pytest.raises(SettingsError, match=field):
        load_settings({"checkpoint": {field: -1}})
    assert getattr(load_settings({"checkpoint": {field: 0}}).checkpoint, field) == 0


@pytest.mark.parametrize("value", [0, -5])
def test_a_lease_grace_that_is_not_positive_is_refused(value):
    with pytest.raises(SettingsError, match="lease_grace_seconds"):
        load_settings({"checkpoint": {"lease_grace_seconds": value}})


def test_an_unknown_field_in_the_block_is_refused(tmp_path):
    with pytest.raises(SettingsError, match="control_auth_tokn"):
        load_settings({"checkpoint": {"enabled": False, "control_auth_tokn": "typo"}})
    with pytest.raises(SettingsError, match="lease_grace"):
        load_settings(write_yaml(tmp_path, "checkpoint:\n  lease_grace: 10\n"))


def test_an_empty_allowed_roots_list_is_refused():
    with pytest.raises(SettingsError, match="allowed_roots"):
        load_settings({"checkpoint": {"allowed_roots": []}})


def test_the_environment_overrides_the_yaml_file(tmp_path, monkeypatch):
    path = write_yaml(
        tmp_path,
        "checkpoint:\n  enabled: false\n  control_auth_token: from-yaml\n  lease_grace_seconds: 30\n",
    )
    monkeypatch.setenv("GYMCKPT_CHECKPOINT__ENABLED", "true")
    monkeypatch.setenv("GYMCKPT_CHECKPOINT__CONTROL_AUTH_TOKEN", TOKEN)
    block = load_settings(path).checkpoint
    assert block.enabled is True  # env wins
    assert block.token == TOKEN  # env wins
    assert block.lease_grace_seconds == 30.0  # what the environment leaves alone stays


def test_the_environment_can_enable_a_dict_block_and_supply_its_token(monkeypatch):
    monkeypatch.setenv("GYMCKPT_CHECKPOINT__ENABLED", "true")
    monkeypatch.setenv("GYMCKPT_CHECKPOINT__CONTROL_AUTH_TOKEN", TOKEN)
    block = load_settings({"checkpoint": {"lease_grace_seconds": 12}}).checkpoint
    assert (block.enabled, block.token, block.lease_grace_seconds) == (True, TOKEN, 12.0)
    assert load_settings().checkpoint.token == TOKEN


def test_the_environment_enabling_without_any_token_fails(monkeypatch):
    monkeypatch.setenv("GYMCKPT_CHECKPOINT__ENABLED", "true")
    with pytest.raises(SettingsError, match="control_auth_token"):
        load_settings({"checkpoint": {}})


def test_environment_values_are_validated_too(monkeypatch):
    monkeypatch.setenv("GYMCKPT_CHECKPOINT__CONTROL_CONNECTOR_LIMIT", "-3")
    with pytest.raises(SettingsError, match="control_connector_limit"):
        load_settings({})
    monkeypatch.setenv("GYMCKPT_CHECKPOINT__CONTROL_CONNECTOR_LIMIT", "4")
    monkeypatch.setenv("GYMCKPT_CHECKPOINT__ALLOWED_ROOTS", '["/data/a", "s3://b/r"]')
    monkeypatch.setenv("GYMCKPT_CHECKPOINT__LEASE_GRACE_SECONDS", "7.5")
    block = load_settings({"checkpoint": {"control_connector_limit": 1}}).checkpoint
    assert block.control_connector_limit == 4
    assert block.allowed_roots == ["/data/a", "s3://b/r"]
    assert block.lease_grace_seconds == 7.5


def test_an_unknown_environment_field_in_the_block_is_refused(monkeypatch):
    monkeypatch.setenv("GYMCKPT_CHECKPOINT__BOGUS", "1")
    with pytest.raises(SettingsError, match="bogus"):
        load_settings({})


def test_the_token_never_shows_in_repr_or_str(monkeypatch):
    settings = load_settings({"checkpoint": {"enabled": True, "control_auth_token": TOKEN}})
    block = settings.checkpoint
    assert isinstance(block.control_auth_token, SecretStr)
    for text in (
        repr(settings),
        str(settings),
        f"{settings}",
        repr(block),
        str(block),
        repr(block.control_auth_token),
        str(block.control_auth_token),
        settings.model_dump_json(),
        block.model_dump_json(),
        str(settings.model_dump()),
    ):
        assert TOKEN not in text
    assert block.control_auth_token.get_secret_value() == TOKEN
    assert block.token == TOKEN

    monkeypatch.setenv("GYMCKPT_CHECKPOINT__CONTROL_AUTH_TOKEN", TOKEN)
    from_env = load_settings({"checkpoint": {"enabled": True}})
    assert TOKEN not in repr(from_env)
    assert TOKEN not in str(from_env)


@pytest.mark.parametrize(
    "block",
    [
        {"enabled": True, "allowed_roots": [], "control_auth_token": TOKEN},
        {"enabled": True, "control_connector_limit": -1, "control_auth_token": TOKEN},
        {"enabled": True, "bogus": 1, "control_auth_token": TOKEN},
        {"enabled": True, "control_auth_token": TOKEN, "lease_grace_seconds": "soon"},
    ],
    ids=["empty-roots", "negative-limit", "unknown-field", "bad-lease"],
)
def test_a_startup_error_never_shows_the_token(block):
    with pytest.raises(SettingsError) as caught:
        load_settings({"checkpoint": block})
    # what a failed startup prints: not the token, nor any recognizable tail of it
    for text in (str(caught.value), repr(caught.value)):
        assert TOKEN[-8:] not in text, text


def test_the_models_can_be_built_directly():
    block = CheckpointSettings(enabled=True, control_auth_token=TOKEN)
    assert block.token == TOKEN
    assert GymckptSettings(checkpoint=block).checkpoint.enabled is True
