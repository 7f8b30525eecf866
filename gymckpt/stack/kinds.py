"""The reference server kinds: each kind's module, config class and app builder, imported when used."""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

from gymckpt import telemetry
from gymckpt.gc_pause import tune_collector

if TYPE_CHECKING:
    from pathlib import Path

    from fastapi import FastAPI

    from gymckpt.servers.base import ServerConfig

__all__ = [
    "CONFIG_ENV",
    "KINDS",
    "KIND_ENV",
    "NOT_GYM",
    "PARTICIPANT_KINDS",
    "app_from_env",
    "build_server",
    "config_fields",
    "load_config",
]

#: server kind → (module, config class, app builder); imported when used
KINDS: dict[str, tuple[str, str, str]] = {
    "inference": ("gymckpt.servers.inference", "InferenceConfig", "build_inference_app"),
    "model": ("gymckpt.servers.model", "ModelServerConfig", "build_model_app"),
    "agent": ("gymckpt.servers.agent", "AgentConfig", "build_agent_app"),
    "counter": ("gymckpt.servers.counter", "CounterConfig", "build_counter_app"),
    "weather": ("gymckpt.servers.weather", "WeatherConfig", "build_weather_app"),
    "sandbox": ("gymckpt.servers.sandbox", "SandboxConfig", "build_sandbox_app"),
    "environment": ("gymckpt.servers.environment", "EnvironmentConfig", "build_environment_app"),
}
#: kinds that are not Gym servers: they get no checkpoint block
NOT_GYM = frozenset({"inference"})
#: server kind → the kind of checkpoint participant it runs
PARTICIPANT_KINDS: dict[str, str] = {
    "model": "model",
    "agent": "agent",
    "counter": "resources",
    "weather": "resources",
    "sandbox": "resources",
    "environment": "environment",
}
#: what ``app_from_env`` reads: the server kind and its config file
KIND_ENV = "GYMCKPT_SERVER_KIND"
CONFIG_ENV = "GYMCKPT_SERVER_CONFIG"


def load_config(kind: str, config: str | Path | dict[str, Any] | None) -> ServerConfig:
    """The config of one server ``kind`` from its file or dict (validated, nothing built).

    A mistake is a :class:`~gymckpt.errors.SettingsError` naming the file and each bad key.
    """
    from gymckpt.control.settings import misspellings
    from gymckpt.errors import SettingsError
    from gymckpt.servers.base import load_server_config

    if kind not in KINDS:
        meant = misspellings({kind: None}, KINDS).get(kind)
        hint = f"; did you mean {meant!r}?" if meant else ""
        raise SettingsError(f"unknown server kind {kind!r}{hint} (one of {', '.join(KINDS)})")
    module_name, config_name, _ = KINDS[kind]
    return load_server_config(getattr(importlib.import_module(module_name), config_name), config)


def build_server(kind: str, config: str | Path | dict[str, Any] | None) -> tuple[FastAPI, ServerConfig]:
    """The app of one server ``kind`` from its config file or dict."""
    loaded = load_config(kind, config)
    module_name, _, builder_name = KINDS[kind]
    return getattr(importlib.import_module(module_name), builder_name)(loaded), loaded


def app_from_env() -> FastAPI:
    """An app factory for ``uvicorn --factory gymckpt.stack:app_from_env``.

    The server kind comes from ``GYMCKPT_SERVER_KIND`` (default ``counter``), its config file
    from ``GYMCKPT_SERVER_CONFIG`` (optional), and the ``checkpoint:`` block may come from
    ``GYMCKPT_CHECKPOINT__…`` variables (``GYMCKPT_CHECKPOINT__ENABLED=true``, …).
    """
    kind = os.environ.get(KIND_ENV, "counter")
    telemetry.setup_logging()  # this worker's own: GYMCKPT_LOG_LEVEL
    tune_collector()  # this worker's own thresholds (GYMCKPT_GC_THRESHOLDS)
    telemetry.configure_from_environment(f"gymckpt-{kind}")
    app, _ = build_server(kind, os.environ.get(CONFIG_ENV) or None)
    return app


def config_fields(kind: str) -> set[str]:
    """The field names of ``kind``'s config class (empty if it cannot be imported)."""
    module_name, config_name, _ = KINDS[kind]
    try:
        return set(getattr(importlib.import_module(module_name), config_name).model_fields)
    except (ImportError, AttributeError):
        return set()
