"""The ``checkpoint:`` settings block, validated once at startup.

Read from a YAML file or a dict; environment variables override it with the prefix
``GYMCKPT_`` and ``__`` between levels, e.g. ``GYMCKPT_CHECKPOINT__ENABLED=true`` or
``GYMCKPT_CHECKPOINT__CONTROL_AUTH_TOKEN=…``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

__all__ = ["CheckpointSettings", "GymckptSettings", "load_settings", "read_yaml_file"]


class CheckpointSettings(BaseModel):
    """Checkpointing of one server; off by default, and then nothing is installed."""

    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)

    enabled: bool = False
    control_auth_token: SecretStr | None = Field(
        default=None, description="Bearer token every control call must carry; required when enabled."
    )
    lease_grace_seconds: float = Field(default=600.0, gt=0, description="Added to a request's deadline.")
    storage_options: dict[str, Any] = Field(default_factory=dict, description="Passed to the store (endpoint, keys).")
    allowed_roots: list[str] | None = Field(
        default=None, description="Paths or URL prefixes checkpoint_dir must lie under; unset allows any."
    )
    control_connector_limit: int = Field(default=0, ge=0, description="Control connection pool size (0: no limit).")
    control_connector_limit_per_host: int = Field(default=0, ge=0, description="Per host (0: no limit).")

    @field_validator("allowed_roots")
    @classmethod
    def _roots_listed(cls, roots: list[str] | None) -> list[str] | None:
        if roots is not None and not roots:
            raise ValueError("checkpoint.allowed_roots must list at least one root, or be left out")
        return roots

    @model_validator(mode="after")
    def _token_when_enabled(self) -> CheckpointSettings:
        if self.enabled and (self.control_auth_token is None or not self.control_auth_token.get_secret_value()):
            raise ValueError("checkpoint.control_auth_token is required when checkpoint.enabled is true")
        return self

    @property
    def token(self) -> str:
        """The control token (empty when unset)."""
        return self.control_auth_token.get_secret_value() if self.control_auth_token else ""


class GymckptSettings(BaseSettings):
    """A server's gymckpt settings: the ``checkpoint:`` block, environment first."""

    model_config = SettingsConfigDict(
        env_prefix="GYMCKPT_", env_nested_delimiter="__", extra="ignore", hide_input_in_errors=True
    )

    checkpoint: CheckpointSettings = Field(default_factory=CheckpointSettings)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return env_settings, init_settings


def read_yaml_file(path: str | Path) -> Any:
    """A YAML file's content; unparseable YAML is ``ValueError("<file>: invalid YAML at line L, column C: …")``."""
    try:
        return yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ValueError(f"{path}: invalid YAML{where}: {getattr(exc, 'problem', None) or exc}") from exc


def load_settings(source: str | Path | dict[str, Any] | None = None) -> GymckptSettings:
    """Settings from a YAML file, a dict (with a top-level ``checkpoint`` key) or nothing.

    Raises ``pydantic.ValidationError`` (a ``ValueError``) naming the bad field, and
    ``ValueError("<file>: invalid YAML at line L, column C: …")`` for a file YAML cannot parse.
    """
    if source is None:
        data: dict[str, Any] = {}
    elif isinstance(source, dict):
        data = source
    else:
        loaded = read_yaml_file(source) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{source}: settings must be a mapping with a 'checkpoint:' block")
        data = loaded
    return GymckptSettings(**{key: value for key, value in data.items() if key == "checkpoint"})
