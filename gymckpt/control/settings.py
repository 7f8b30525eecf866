"""The ``checkpoint:`` settings block, validated once at startup.

Read from a YAML file or a dict; environment variables override it with the prefix
``GYMCKPT_`` and ``__`` between levels, e.g. ``GYMCKPT_CHECKPOINT__ENABLED=true`` or
``GYMCKPT_CHECKPOINT__CONTROL_AUTH_TOKEN=…``.

A settings mistake is a :class:`~gymckpt.errors.SettingsError` at startup, one
``file: key.path: why`` line per problem (:func:`validate_settings`), never a value (a token
stays out of it). A key that is not one a file may hold but looks like one (``chekpoint``,
``Checkpoint``, ``checkpoints``, ``check_point``: :func:`looks_like`) is refused with a
did-you-mean (:func:`misspelled_keys`), also where unknown keys are otherwise allowed: a
misspelled ``checkpoint:`` would leave checkpointing silently off.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, get_args

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from gymckpt.errors import CheckpointDirNotAllowed, SettingsError

if TYPE_CHECKING:
    from collections.abc import Callable, Collection, Iterable, Mapping

__all__ = [
    "CheckpointSettings",
    "GymckptSettings",
    "checkpointing_summary",
    "did_you_mean",
    "key_path",
    "load_settings",
    "looks_like",
    "misspelled_keys",
    "misspellings",
    "read_yaml_file",
    "settings_problems",
    "validate_settings",
]

T = TypeVar("T")


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
    exempt_paths: list[str] = Field(
        default_factory=list,
        description="Paths (exact, starting with /) served without a rollout: never fenced, counted or held.",
    )
    control_connector_limit_per_host: int = Field(default=0, ge=0, description="Per host (0: no limit).")

    @field_validator("allowed_roots")
    @classmethod
    def _roots_listed(cls, roots: list[str] | None) -> list[str] | None:
        if roots is not None and not roots:
            raise ValueError("checkpoint.allowed_roots must list at least one root, or be left out")
        return roots

    @field_validator("exempt_paths")
    @classmethod
    def _paths_absolute(cls, paths: list[str]) -> list[str]:
        for path in paths:
            if not path.startswith("/") or path.startswith("/ng-control/") or path.startswith("/ng-rollout/"):
                raise ValueError(
                    f"checkpoint.exempt_paths: {path!r} must be a path starting with / (not a gymckpt route)"
                )
        return paths

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
    """A YAML file's content; unparseable YAML is ``SettingsError("<file>: invalid YAML at line L, column C: …")``."""
    try:
        return yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise SettingsError(f"invalid YAML{where}: {getattr(exc, 'problem', None) or exc}", path=str(path)) from None


# --- keys that look like another


def _distance(a: str, b: str) -> int:
    """The optimal-string-alignment distance: insertions, deletions, substitutions, adjacent swaps."""
    previous2: list[int] = []
    previous = list(range(len(b) + 1))
    for i, left in enumerate(a, 1):
        current = [i]
        for j, right in enumerate(b, 1):
            cost = min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (left != right))
            if i > 1 and j > 1 and left == b[j - 2] and a[i - 2] == right:
                cost = min(cost, previous2[j - 2] + 1)
            current.append(cost)
        previous2, previous = previous, current
    return previous[-1]


def _squashed(key: str) -> str:
    return re.sub(r"[\s_\-]", "", key.lower())


def looks_like(key: str, known: str) -> bool:
    """Whether ``key`` is likely a misspelling of ``known``.

    The same but for case, ``_``, ``-`` or a trailing ``s`` (``Checkpoint``, ``check_point``,
    ``checkpoints``), or at most 2 edits away (1 for a name under 6 letters, where 2 edits
    reach unrelated words: ``host``/``port``); an adjacent swap is one edit.
    """
    if key == known:
        return False
    a, b = _squashed(key), _squashed(known)
    if a in (b, b + "s") or b == a + "s":
        return True
    return _distance(key.lower(), known.lower()) <= (2 if len(known) >= 6 else 1)


def _closest(key: str, known: Iterable[str]) -> str | None:
    candidates = [name for name in known if looks_like(key, name)]
    return min(candidates, key=lambda name: (_distance(key.lower(), name.lower()), name)) if candidates else None


def misspellings(data: Mapping[Any, Any], known: Collection[str]) -> dict[str, str]:
    """Each key of ``data`` that is not in ``known`` but looks like one of them → the one it looks like."""
    found = {}
    for key in data:
        if isinstance(key, str) and key not in known:
            closest = _closest(key, known)
            if closest is not None:
                found[key] = closest
    return found


def did_you_mean(meant: str) -> str:
    """The ``why`` of a misspelled key."""
    return f"unknown key; did you mean {meant!r}?"


def misspelled_keys(data: Mapping[Any, Any], known: Collection[str], *, prefix: str = "") -> list[tuple[str, str]]:
    """``(key path, why)`` for each key of ``data`` that is not in ``known`` but looks like one of them."""
    return [(prefix + key, did_you_mean(meant)) for key, meant in misspellings(data, known).items()]


# --- pydantic's errors as settings errors


def key_path(loc: Iterable[Any]) -> str:
    """``servers[2].config.model_url`` from pydantic's ``("servers", 2, "config", "model_url")``."""
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for argument in get_args(annotation):
        found = _model_in(argument)
        if found is not None:
            return found
    return None


def _model_at(model: type[BaseModel] | None, loc: Iterable[Any]) -> type[BaseModel] | None:
    """The model that validated the mapping at ``loc`` (list indexes skipped), None if not a model."""
    for part in loc:
        if model is None:
            return None
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        model = _model_in(field.annotation) if field is not None else None
    return model


def _env_name(loc: tuple[Any, ...]) -> str | None:
    """The ``GYMCKPT_…`` variable set for ``loc`` (of a settings model), None when none is."""
    if not loc or not all(isinstance(part, str) for part in loc):
        return None
    name = "GYMCKPT_" + "__".join(loc).upper()
    return next((variable for variable in os.environ if variable.upper() == name), None)


def _problem(error: Any, model: type[BaseModel] | None, prefix: str) -> tuple[str, str]:
    loc = tuple(error.get("loc", ()))
    why = str(error.get("msg", "invalid"))
    for boilerplate in ("Value error, ", "Assertion failed, "):
        why = why.removeprefix(boilerplate)
    if error.get("type") == "extra_forbidden" and loc and isinstance(loc[-1], str):
        fields = set((_model_at(model, loc[:-1]) or BaseModel).model_fields)
        closest = _closest(loc[-1], fields)
        if closest is not None:
            why = did_you_mean(closest)
        else:
            why = "unknown key" + (f" (known: {', '.join(sorted(fields))})" if fields else "")
    elif error.get("type") == "missing":
        why = "required, and not given"
    key = prefix + key_path(loc) if loc else prefix.rstrip(".")
    # only a settings model reads GYMCKPT_… variables (where the environment wins over the file)
    variable = _env_name(loc) if isinstance(model, type) and issubclass(model, BaseSettings) else None
    return (f"{key} (from {variable})" if variable else key), why


def settings_problems(
    exc: ValidationError, *, model: type[BaseModel] | None = None, prefix: str = "", given_as: Collection[str] = ()
) -> list[tuple[str, str]]:
    """``(key path, why)`` for each error of ``exc``: pydantic's wording without its links, never the value.

    An unknown key gets a did-you-mean when it looks like one of ``model``'s fields; a
    top-level field in ``given_as`` (reported misspelled already) is not also reported missing.
    """
    return [
        _problem(error, model, prefix)
        for error in exc.errors(include_url=False, include_input=False)
        if not (error.get("type") == "missing" and len(error["loc"]) == 1 and error["loc"][0] in given_as)
    ]


def validate_settings(
    build: Callable[[], T],
    *,
    model: type[BaseModel] | None = None,
    path: str | Path = "",
    prefix: str = "",
    problems: list[tuple[str, str]] | None = None,
) -> T:
    """``build()``; its :class:`~pydantic.ValidationError`, and ``problems`` found before, as one SettingsError.

    Each problem is a ``path: <prefix><key path>: why`` line (:func:`settings_problems`).
    ``problems`` already found (misspelled keys) are raised even when ``build()`` succeeds.
    """
    found = list(problems or [])
    try:
        built = build()
    except ValidationError as exc:
        found.extend(settings_problems(exc, model=model, prefix=prefix))
        raise SettingsError(found, path=str(path)) from None
    if found:
        raise SettingsError(found, path=str(path))
    return built


# --- loading


def load_settings(source: str | Path | dict[str, Any] | None = None) -> GymckptSettings:
    """Settings from a YAML file, a dict (with a top-level ``checkpoint`` key) or nothing.

    Other top-level keys are left alone (a server's own settings, a stack file), except one
    that looks like ``checkpoint``. Raises :class:`~gymckpt.errors.SettingsError` (a
    ``ValueError``) naming the file and each bad key, and ``SettingsError("<file>: invalid
    YAML at line L, column C: …")`` for a file YAML cannot parse.
    """
    path = ""
    if source is None:
        data: dict[str, Any] = {}
    elif isinstance(source, dict):
        data = source
    else:
        path = str(source)
        loaded = read_yaml_file(source) or {}
        if not isinstance(loaded, dict):
            raise SettingsError("settings must be a mapping with a 'checkpoint:' block", path=path)
        data = loaded
    misspelled = misspelled_keys(data, GymckptSettings.model_fields)
    block = {key: value for key, value in data.items() if key == "checkpoint"}
    return validate_settings(lambda: GymckptSettings(**block), model=GymckptSettings, path=path, problems=misspelled)


def checkpointing_summary(block: CheckpointSettings | None) -> str:
    """What a startup line says of checkpointing: off, or on with its allowed roots (never the token)."""
    if block is None or not block.enabled:
        return "checkpointing off"
    if block.allowed_roots is None:
        return "checkpointing on, any root (checkpoint.allowed_roots unset)"
    from gymckpt.control.allowed_roots import normalize_location

    roots = []
    for root in block.allowed_roots:
        try:
            roots.append(normalize_location(root))  # as requests are compared: resolved real paths
        except CheckpointDirNotAllowed:  # a URL root with '.' segments: shown as given
            roots.append(root)
    return f"checkpointing on, allowed roots {', '.join(roots)}"
