"""Build a NeMo Gym server's app with checkpointing, from its YAML config, in the right order by construction.

``gymckpt serve --app gymckpt.integrations.nemo_gym:app --config my_env.yaml [--workers N]``
(or a stack file entry ``{app: "gymckpt.integrations.nemo_gym:app", config: {...}}``) runs
the instance the file names (:mod:`gymckpt.integrations.nemo_gym.config`) as NeMo Gym's
``run_webserver`` would, without its head server, Ray or its own ``uvicorn.run``:

1. NeMo Gym's global config is the file (``NEMO_GYM_CONFIG_DICT``, ``NEMO_GYM_CONFIG_PATH``
   set for NeMo Gym code that reads it); the server is built from its class and its
   instance config, with a :class:`~gymckpt.integrations.nemo_gym.client.CheckpointedServerClient`;
2. ``setup_webserver()``, NeMo Gym's liveness route (``GET /``) and exception middleware;
3. with ``checkpoint.enabled``: a resources server becomes a resources participant from its
   declarations, its sessions bound to capture keys inside NeMo Gym's session middleware;
   an agent becomes an agent participant whose ``/run`` and ``/v1/responses`` are journaled
   activations; then ``install_checkpointing`` (the control routes, the rollout prefix, the
   participant's middleware outermost; in a worker of several, the link to the coordinator).

NeMo Gym's liveness and metrics routes (``GET /``, ``/aggregate_metrics``, ``/stats``) are
exempt from the rollout prefix by default; ``checkpoint.exempt_paths`` adds more.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from gymckpt.control.responses import handle_gymckpt_error
from gymckpt.errors import GymckptError, SettingsError
from gymckpt.integrations.nemo_gym.config import AGENTS, MODELS, RESOURCES, NeMoGymServeConfig, load_serve_config
from gymckpt.participants.install import app_config_file, install_checkpointing

if TYPE_CHECKING:
    from pathlib import Path

    from fastapi import FastAPI

__all__ = ["NEMO_GYM_EXEMPT_PATHS", "app", "build_nemo_gym_app"]

#: NeMo Gym's routes that are no rollout's work: its liveness probe, metrics, the profiler's stats
NEMO_GYM_EXEMPT_PATHS = frozenset({"/", "/aggregate_metrics", "/stats"})


def _publish_global_config(serve: NeMoGymServeConfig) -> Any:
    """NeMo Gym's global config, as its own code finds it in a server process it started."""
    from nemo_gym import global_config
    from omegaconf import OmegaConf

    config = OmegaConf.create(serve.global_config)
    os.environ[global_config.NEMO_GYM_CONFIG_DICT_ENV_VAR_NAME] = OmegaConf.to_yaml(config)
    os.environ[global_config.NEMO_GYM_CONFIG_PATH_ENV_VAR_NAME] = serve.instance.name
    return config


def _server(serve: NeMoGymServeConfig, global_config: Any) -> Any:
    """The NeMo Gym server object: its class, its instance config, a checkpointed ServerClient."""
    from nemo_gym.config_types import BaseServerConfig
    from pydantic import ValidationError

    from gymckpt.integrations.nemo_gym.client import CheckpointedServerClient

    cls = serve.server_class()
    if serve.checkpoint.enabled and serve.instance.server_type == RESOURCES:
        from gymckpt.integrations.nemo_gym.sessions import session_signing_key, signed_with

        cls = signed_with(cls, session_signing_key(serve.checkpoint.token, cls))
    fields = {"host": "127.0.0.1", "port": 0, **serve.instance.fields, "name": serve.instance.name}
    config_cls = cls.model_fields["config"].annotation
    try:
        config = config_cls.model_validate(fields)
    except ValidationError as exc:
        raise SettingsError(f"{serve.instance.name}: {exc}", path=str(serve.path)) from None
    client = CheckpointedServerClient(
        head_server_config=BaseServerConfig(host="127.0.0.1", port=0), global_config_dict=global_config
    )
    client.configure(
        own_name=serve.instance.name, checkpointing=serve.checkpoint.enabled, unprefixed=serve.block.unprefixed_servers
    )
    return cls(config=config, server_client=client)


def build_nemo_gym_app(config_file: str | Path) -> FastAPI:
    """The app of the NeMo Gym server ``config_file`` names, checkpointed as its ``checkpoint:`` block says."""
    serve = load_serve_config(config_file)
    if serve.instance.server_type == MODELS and serve.checkpoint.enabled:
        raise SettingsError(
            [
                (
                    "nemo_gym.serve",
                    f"{serve.instance.name} is a model server: serve the policy model with `gymckpt serve model` "
                    "(a Responses API server NeMo Gym's agents call), or turn checkpoint.enabled off for this one",
                )
            ],
            path=str(serve.path),
        )
    server = _server(serve, _publish_global_config(serve))
    app = server.setup_webserver()
    server.setup_liveness(app)
    server.setup_exception_middleware(app)
    app.add_exception_handler(GymckptError, handle_gymckpt_error)
    app.state.nemo_gym_server = server
    server.server_client.configure(
        own_name=serve.instance.name,
        checkpointing=serve.checkpoint.enabled,
        unprefixed=serve.block.unprefixed_servers,
        app=app,
    )
    participant = _participant(serve, server, app)
    app.state.participant = participant
    if participant is None:
        return app
    participant.exempt_paths = participant.exempt_paths | NEMO_GYM_EXEMPT_PATHS
    app.state.plane = install_checkpointing(app, participant, serve.checkpoint)
    return app


def _participant(serve: NeMoGymServeConfig, server: Any, app: FastAPI) -> Any:
    """The participant of the server's type, its middleware placed (None with checkpointing off)."""
    if not serve.checkpoint.enabled:
        return None
    name = serve.instance.name
    if serve.instance.server_type == RESOURCES:
        from gymckpt.integrations.nemo_gym.declarations import DeclaredSessions, declaration_of
        from gymckpt.integrations.nemo_gym.sessions import bind_sessions, session_signing_key
        from gymckpt.participants.resources import ResourcesParticipant

        sessions = DeclaredSessions(server, declaration_of(type(server), serve.block, path=str(serve.path)))
        participant = ResourcesParticipant(sessions, instance=name)
        bind_sessions(app, sessions, participant, signing_key=session_signing_key(serve.checkpoint.token, type(server)))
        app.state.sessions = sessions
        return participant
    if serve.instance.server_type == AGENTS:
        from gymckpt.integrations.nemo_gym.agent import AgentActivationMiddleware
        from gymckpt.integrations.nemo_gym.journal import JournalBook
        from gymckpt.participants.agent import AgentSessionParticipant

        journals = JournalBook()
        agent_participant = AgentSessionParticipant(journals, instance=name)
        app.add_middleware(AgentActivationMiddleware, participant=agent_participant, journals=journals)
        app.state.journals = journals
        return agent_participant
    return None


INSTALL_HINT = "pip install nemo-gym==0.4.0 (Python 3.12), beside gymckpt"


def app() -> FastAPI:
    """The factory ``gymckpt serve --app gymckpt.integrations.nemo_gym:app --config FILE`` calls."""
    import importlib.util

    if importlib.util.find_spec("nemo_gym") is None:
        raise ImportError(f"gymckpt.integrations.nemo_gym needs NeMo Gym: {INSTALL_HINT}")
    config_file = app_config_file()
    if config_file is None:
        raise SettingsError(
            "gymckpt.integrations.nemo_gym:app serves the NeMo Gym server a config file names: give --config FILE "
            "(a stack file entry: config:)"
        )
    return build_nemo_gym_app(config_file)
