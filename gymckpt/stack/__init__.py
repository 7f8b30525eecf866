"""Run the reference servers as a stack of real processes, and drive it as a controller would.

- :mod:`gymckpt.stack.kinds`: the server kinds (:data:`KINDS`), :func:`build_server` for
  one server's app, and :func:`app_from_env` (``uvicorn --factory gymckpt.stack:app_from_env``);
- :mod:`gymckpt.stack.apps`: an app of your own served as a kind is (``gymckpt serve --app
  module:attr``): :func:`load_app` and the :class:`LoadedApp` it gives;
- :mod:`gymckpt.stack.supervisor`: :class:`Stack` and :class:`ServerProcess`, servers in
  their own process groups on kept sockets (SIGKILL, restart on the same port), and
  :func:`load_stack` from a stack file or dict;
- :mod:`gymckpt.stack.harness`: :class:`RolloutHarness`, the controller's side of a running
  stack (rollouts, checkpoint, crash, restart, restore), and the reference stack's spec
  and tasks (:func:`default_stack_spec`, :func:`task_for`).

This package uses :mod:`gymckpt.servers`; the servers never use it. Names are imported
when first used, so ``gymckpt verify`` does not load the harness's HTTP client.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gymckpt.stack.apps import LoadedApp, load_app
    from gymckpt.stack.harness import (
        CheckpointOutcome,
        RestoreOutcome,
        RolloutHarness,
        StackNotReady,
        default_stack_spec,
        task_for,
    )
    from gymckpt.stack.kinds import KINDS, app_from_env, build_server
    from gymckpt.stack.supervisor import ServerProcess, Stack, load_stack

__all__ = [
    "KINDS",
    "CheckpointOutcome",
    "LoadedApp",
    "RestoreOutcome",
    "RolloutHarness",
    "ServerProcess",
    "Stack",
    "StackNotReady",
    "app_from_env",
    "build_server",
    "default_stack_spec",
    "load_app",
    "load_stack",
    "task_for",
]

#: public name → the module that defines it
_HOME = {
    "KINDS": "kinds",
    "app_from_env": "kinds",
    "build_server": "kinds",
    "LoadedApp": "apps",
    "load_app": "apps",
    "ServerProcess": "supervisor",
    "Stack": "supervisor",
    "load_stack": "supervisor",
    "CheckpointOutcome": "harness",
    "RestoreOutcome": "harness",
    "RolloutHarness": "harness",
    "StackNotReady": "harness",
    "default_stack_spec": "harness",
    "task_for": "harness",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
