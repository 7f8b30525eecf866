"""One NeMo Gym YAML config, read for gymckpt: the server this process runs, and how it is checkpointed.

The file is NeMo Gym's own config (server instances at the top level, each
``<name>: {<server type>: {<directory>: {entrypoint, host, port, …}}}``) with two blocks of
gymckpt's beside them:

- ``checkpoint:``: the block every gymckpt server reads (``enabled``, ``control_auth_token``,
  ``allowed_roots``, ``exempt_paths``, …; ``GYMCKPT_CHECKPOINT__…`` variables override it);
- ``nemo_gym:``: which instance this process serves (``serve``, else the file's only
  instance with an ``entrypoint``), the server class when the entrypoint module defines more
  than one (``server_class``), the servers its clients call without a rollout prefix
  (``unprefixed_servers``: a judge model that is no checkpoint participant), and for a
  resources server the declarations of :mod:`gymckpt.integrations.nemo_gym.declarations`
  (``sessions``, ``session_state``, ``verify``).

Every other instance in the file tells this server's ``ServerClient`` where that server
listens (its ``host`` and ``port``), as NeMo Gym's global config does. Interpolations
(``${…}``) are resolved with OmegaConf, as NeMo Gym resolves them.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from gymckpt.control.settings import CheckpointSettings, load_settings, read_yaml_file, settings_problems
from gymckpt.errors import SettingsError

__all__ = [
    "AGENTS",
    "MODELS",
    "RESOURCES",
    "SERVER_TYPES",
    "NeMoGymBlock",
    "NeMoGymServeConfig",
    "ServedInstance",
    "load_serve_config",
]

RESOURCES = "resources_servers"
AGENTS = "responses_api_agents"
MODELS = "responses_api_models"
#: NeMo Gym's three server types, as the second level of an instance's config names them
SERVER_TYPES = (RESOURCES, AGENTS, MODELS)
#: top-level keys of the file that are gymckpt's, never a NeMo Gym instance
GYMCKPT_KEYS = ("checkpoint", "nemo_gym")


class NeMoGymBlock(BaseModel):
    """The ``nemo_gym:`` block: what this process serves and how its sessions are checkpointed."""

    model_config = ConfigDict(extra="forbid")

    #: the instance of the file this process runs (default: the only one with an entrypoint)
    serve: str | None = None
    #: the server class, by name in the entrypoint module or as ``module:Class``
    server_class: str | None = None
    #: instances the client calls without a rollout prefix (servers that are no checkpoint participant)
    unprefixed_servers: list[str] = []
    #: a resources server's sessions: exported, stateless or restart_only (default: the class's declaration)
    sessions: Literal["exported", "stateless", "restart_only"] | None = None
    #: the attribute holding ``{session id: state}`` of an exported resources server
    session_state: str | None = None
    #: whether the resources server's /verify may run again after a crash (default: the class's, else wait)
    verify: Literal["wait", "replay"] | None = None


@dataclass(frozen=True)
class ServedInstance:
    """The NeMo Gym server instance this process runs."""

    #: its name in the file (NeMo Gym's ``config.name``, which also names its session cookie)
    name: str
    #: resources_servers, responses_api_agents or responses_api_models
    server_type: str
    #: the directory under the server type (``example_session_state_mgmt``)
    directory: str
    #: its resolved config (entrypoint, host, port, its own fields)
    fields: dict[str, Any]

    @property
    def module(self) -> str:
        """The entrypoint's module: ``resources_servers.example_session_state_mgmt.app``."""
        entrypoint = str(self.fields.get("entrypoint") or "app.py")
        return ".".join([self.server_type, self.directory, *Path(entrypoint).with_suffix("").parts])


@dataclass(frozen=True)
class NeMoGymServeConfig:
    """A NeMo Gym config file, read: the global config, the instance served, gymckpt's two blocks."""

    path: Path
    #: NeMo Gym's global config: every instance, resolved (gymckpt's blocks left out)
    global_config: dict[str, Any]
    instance: ServedInstance
    checkpoint: CheckpointSettings
    block: NeMoGymBlock

    def server_class(self) -> type:
        """The server class: ``nemo_gym.server_class``, else the one concrete server the entrypoint defines."""
        return _server_class(self.instance, self.block.server_class, str(self.path))


def _instances(global_config: dict[str, Any]) -> dict[str, ServedInstance]:
    """Every top-level entry shaped like a NeMo Gym server instance."""
    found = {}
    for name, value in global_config.items():
        if not isinstance(value, dict) or len(value) != 1:
            continue
        ((server_type, inner),) = value.items()
        if server_type not in SERVER_TYPES or not isinstance(inner, dict) or len(inner) != 1:
            continue
        ((directory, fields),) = inner.items()
        if isinstance(fields, dict):
            found[name] = ServedInstance(str(name), server_type, str(directory), dict(fields))
    return found


def _resolved(path: str, data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with NeMo Gym's ``${…}`` interpolations resolved (OmegaConf, NeMo Gym's own dependency)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        resolved = OmegaConf.to_container(OmegaConf.create(data), resolve=True)
    except OmegaConfBaseException as exc:
        raise SettingsError(f"cannot resolve an interpolation: {exc}", path=path) from None
    assert isinstance(resolved, dict)
    return {str(key): value for key, value in resolved.items()}


def load_serve_config(source: str | Path) -> NeMoGymServeConfig:
    """Read a NeMo Gym config file for ``gymckpt serve --app gymckpt.integrations.nemo_gym:app``.

    Raises :class:`~gymckpt.errors.SettingsError` naming the file and the key: no instance
    to serve (or several and no ``nemo_gym.serve``), a ``serve`` that names none, a bad
    ``checkpoint:`` or ``nemo_gym:`` block.
    """
    path = str(source)
    raw = read_yaml_file(source) or {}
    if not isinstance(raw, dict):
        raise SettingsError("a NeMo Gym config must be a mapping of server instances", path=path)
    settings = load_settings(source)  # the checkpoint: block as every gymckpt server reads it (GYMCKPT_ overrides)
    try:
        block = NeMoGymBlock.model_validate(raw.get("nemo_gym") or {})
    except ValidationError as exc:
        problems = [(f"nemo_gym.{key}", why) for key, why in settings_problems(exc, model=NeMoGymBlock)]
        raise SettingsError(problems, path=path) from None
    global_config = _resolved(path, {key: value for key, value in raw.items() if key not in GYMCKPT_KEYS})
    instances = _instances(global_config)
    served = [name for name, instance in instances.items() if instance.fields.get("entrypoint")]
    if block.serve is not None:
        if block.serve not in instances:
            known = ", ".join(sorted(instances)) or "none"
            raise SettingsError(
                [("nemo_gym.serve", f"{block.serve!r} is no server instance of this file ({known})")], path=path
            )
        name = block.serve
    elif len(served) == 1:
        name = served[0]
    else:
        which = f"one of {', '.join(sorted(served))}" if served else "an instance with an entrypoint"
        raise SettingsError([("nemo_gym.serve", f"required: the instance this process serves ({which})")], path=path)
    return NeMoGymServeConfig(Path(path), global_config, instances[name], settings.checkpoint, block)


def _server_class(instance: ServedInstance, named: str | None, path: str) -> type:
    """Import the entrypoint module and find the server class in it."""
    from nemo_gym.server_utils import SimpleServer

    module_name, class_name = instance.module, named
    if named is not None and ":" in named:
        module_name, _, class_name = named.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise SettingsError(
            [
                (
                    f"{instance.name}.{instance.server_type}.{instance.directory}.entrypoint",
                    f"cannot import {module_name}: {exc}",
                )
            ],
            path=path,
        ) from None
    if class_name:
        found = getattr(module, class_name, None)
        if not (inspect.isclass(found) and issubclass(found, SimpleServer)):
            raise SettingsError(
                [("nemo_gym.server_class", f"{module_name} defines no NeMo Gym server {class_name!r}")], path=path
            )
        return found
    defined = [
        value
        for value in vars(module).values()
        if inspect.isclass(value)
        and value.__module__ == module.__name__
        and issubclass(value, SimpleServer)
        and not inspect.isabstract(value)
    ]
    if len(defined) != 1:
        names = ", ".join(sorted(cls.__name__ for cls in defined)) or "none"
        raise SettingsError(
            [("nemo_gym.server_class", f"required: {module_name} defines {len(defined)} concrete servers ({names})")],
            path=path,
        )
    return defined[0]
