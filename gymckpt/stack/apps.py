"""Your own app, served as a reference server is: ``gymckpt serve --app module:attr [--workers N]``.

``module:attr`` names a FastAPI (any Starlette) app, or a factory that takes no arguments
and returns one (``attr`` may be dotted). The module is imported with the current directory
first on ``sys.path``, as uvicorn does. :func:`load_app` refuses, with one
:class:`~gymckpt.errors.AppNotLoadable` line, a module that cannot be imported (or raised
while it was), an attribute it lacks, and an attribute that is neither an app nor such a
factory; a :class:`~gymckpt.errors.SettingsError` the app's own settings raise stays what it is.

The app's settings file (``--config FILE``, a stack entry's ``config:``) reaches the app as
:data:`~gymckpt.participants.install.APP_CONFIG_ENV`, set before the module is imported
(:func:`~gymckpt.participants.install.app_config_file` reads it).

What it shares with the reference kinds (:func:`~gymckpt.stack.serving.serve`): the process
model (one process, or ``--workers N`` uvicorn workers whose main process coordinates them
as one checkpoint participant), the request deadlines and connection budget, and the
startup line. With several workers the main process builds the app once, only to learn
from its ``install_checkpointing`` call the participant's kind and instance and the
checkpoint block (:func:`~gymckpt.participants.install.installed_on`); it starts the
coordinator from them and never serves that app (a factory is called there too). Each
worker builds its own (:func:`app_from_env`), and its ``install_checkpointing`` links it to
the coordinator; an app that makes no such call gets the session routing alone.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import os
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gymckpt import telemetry
from gymckpt.control.settings import checkpointing_summary
from gymckpt.errors import AppNotLoadable, SettingsError
from gymckpt.gc_pause import tune_collector
from gymckpt.participants.install import APP_CONFIG_ENV, Installed, building_only, installed_on, link_workers_with

__all__ = ["APP_ENV", "LoadedApp", "app_from_env", "check_app_spec", "load_app", "parse_app_spec"]

logger = logging.getLogger(__name__)

#: what :func:`app_from_env` reads in each worker: the ``module:attr`` of the app
APP_ENV = "GYMCKPT_APP"


@dataclass(frozen=True)
class LoadedApp:
    """An app :func:`load_app` built, and what ``install_checkpointing`` found for it (None: no call)."""

    spec: str
    app: Any
    installed: Installed | None

    @property
    def block(self) -> Any:
        """The enabled ``checkpoint:`` block (None: checkpointing off, or no ``install_checkpointing`` call)."""
        return self.installed.block if self.installed is not None else None

    @property
    def service_name(self) -> str:
        """The telemetry service name: ``gymckpt-<participant kind>``, as ``install_checkpointing`` sets it."""
        return f"gymckpt-{self.installed.kind}" if self.installed is not None else "gymckpt-app"

    def startup_line(self, url: str, *, workers: int = 1) -> str:
        """The one line the server logs at startup: which app, where it listens, checkpointing on or off."""
        installed = self.installed
        title = str(getattr(self.app, "title", "") or "")
        who = f"{installed.kind}/{installed.instance}" if installed is not None else "no checkpoint participant"
        about = f"{title}, {who}" if title else who
        several = f" with {workers} workers" if workers > 1 else ""
        return f"{self.spec} ({about}) listening on {url}{several}, {checkpointing_summary(self.block)}"


def parse_app_spec(spec: str) -> tuple[str, str]:
    """``(module, attr)`` of ``module:attr``; :class:`~gymckpt.errors.AppNotLoadable` for another shape."""
    module, sep, attr = spec.partition(":")
    names = [*module.split("."), *attr.split(".")]
    if not sep or not module or not attr or not all(name.isidentifier() for name in names):
        raise AppNotLoadable(
            f"--app {spec!r}: give the app as module:attr, e.g. examples.tool_server:app (a FastAPI app, "
            "or a factory that takes no arguments and returns one)"
        )
    return module, attr


def _current_directory_first() -> None:
    """The current directory first on ``sys.path`` (uvicorn's ``--app-dir .``): ``examples.tool_server`` is found."""
    here = os.getcwd()
    if here not in sys.path:
        sys.path.insert(0, here)


def check_app_spec(spec: str) -> None:
    """Refuse a ``module:attr`` whose module is not to be found, without importing (running) it."""
    module, _ = parse_app_spec(spec)
    _current_directory_first()
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError) as exc:  # a parent package missing, or one that raised
        raise AppNotLoadable(f"--app {spec}: cannot import {module}: {exc}") from None
    if found is None:
        raise AppNotLoadable(f"--app {spec}: no module named {module!r} (from {os.getcwd()})")


def _import(module: str, spec: str) -> Any:
    try:
        return importlib.import_module(module)
    except SettingsError:
        raise  # the app's own settings: the file and the key already named
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module == exc.name or module.startswith(f"{exc.name}.")):
            raise AppNotLoadable(f"--app {spec}: no module named {exc.name!r} (from {os.getcwd()})") from None
        raise AppNotLoadable(f"--app {spec}: importing {module} failed: {exc}") from exc
    except Exception as exc:
        logger.debug("importing %s failed", module, exc_info=exc)  # the traceback, for --log-level debug
        raise AppNotLoadable(f"--app {spec}: importing {module} raised {type(exc).__name__}: {exc}") from exc


def _attribute(module: Any, attr: str, spec: str) -> Any:
    target = module
    for name in attr.split("."):
        try:
            target = getattr(target, name)
        except AttributeError:
            raise AppNotLoadable(f"--app {spec}: module {module.__name__} has no attribute {attr!r}") from None
    return target


def _is_app(value: Any) -> bool:
    from starlette.applications import Starlette

    return isinstance(value, Starlette)


def _app_of(target: Any, spec: str) -> Any:
    """``target`` if it is an app, else what calling it (a factory, no arguments) returns."""
    if _is_app(target):
        return target
    if not callable(target):
        raise AppNotLoadable(
            f"--app {spec} is a {type(target).__name__}, not a FastAPI app or a factory that returns one"
        )
    try:
        inspect.signature(target).bind()
    except TypeError:
        raise AppNotLoadable(
            f"--app {spec}: a factory is called with no arguments, and {spec.partition(':')[2]} needs some"
        ) from None
    except ValueError:  # no signature to read (a builtin): call it and see
        pass
    try:
        app = target()
    except SettingsError:
        raise
    except Exception as exc:
        logger.debug("the factory %s failed", spec, exc_info=exc)
        raise AppNotLoadable(f"--app {spec}: the factory raised {type(exc).__name__}: {exc}") from exc
    if not _is_app(app):
        raise AppNotLoadable(f"--app {spec}: the factory returned a {type(app).__name__}, not a FastAPI app")
    return app


def load_app(spec: str, *, config_file: str | Path | None = None, serving_here: bool = True) -> LoadedApp:
    """Import ``module:attr`` and build its app (a factory is called); what it installed comes with it.

    ``config_file`` is the app's settings file: :data:`~gymckpt.participants.install.APP_CONFIG_ENV`
    names it (resolved) before the module is imported. ``serving_here`` False: the app is
    built only to learn its participant (the main process of several workers); its control
    plane logs no startup warnings then, the coordinator does.
    """
    module_name, attr = parse_app_spec(spec)
    if config_file is not None:
        os.environ[APP_CONFIG_ENV] = str(Path(config_file).resolve())
    _current_directory_first()
    with nullcontext() if serving_here else building_only():
        app = _app_of(_attribute(_import(module_name, spec), attr, spec), spec)
    return LoadedApp(spec, app, installed_on(app))


def app_from_env() -> Any:
    """The app factory of each worker of ``gymckpt serve --app M:A --workers N`` (``GYMCKPT_APP``).

    Its logging is set up first (``GYMCKPT_LOG_LEVEL``, as the reference kinds' workers);
    building the app links it to the coordinator (its ``install_checkpointing``); an app
    without that call gets the session routing of a worker alone.
    """
    from gymckpt.workers.process import install_worker

    telemetry.setup_logging()  # this worker's own: GYMCKPT_LOG_LEVEL
    tune_collector()  # this worker's own thresholds (GYMCKPT_GC_THRESHOLDS)
    environ = dict(os.environ)
    link_workers_with(lambda app, participant, block: install_worker(app, participant, block, environ))
    loaded = load_app(environ[APP_ENV])
    if loaded.installed is None:
        install_worker(loaded.app, None, None, environ)
    telemetry.configure_from_environment(loaded.service_name)  # done already when the app installed checkpointing
    return loaded.app
