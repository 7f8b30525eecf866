"""NeMo Gym servers and agents checkpointed by configuration, not code.

``gymckpt serve --app gymckpt.integrations.nemo_gym:app --config my_env.yaml`` serves the
NeMo Gym server a NeMo Gym YAML config names, with the ``checkpoint:`` block of the same
file (README: "Checkpointing a NeMo Gym stack"). Needs NeMo Gym (the ``nemo-gym`` extra,
Python 3.12); the rest of gymckpt never imports this package, and only this package imports
``nemo_gym``.

- :mod:`.config`: the file read (the instance served, the ``nemo_gym:`` block);
- :mod:`.serving`: the app, its middleware in the right order by construction;
- :mod:`.declarations`: a resources server's session state declared, exported by gymckpt;
- :mod:`.sessions`: NeMo Gym sessions bound to rollouts (cookies and MCP tokens);
- :mod:`.client`, :mod:`.journal`, :mod:`.agent`: NeMo Gym's ServerClient and agents, journaled.
"""

from __future__ import annotations

from gymckpt.integrations.nemo_gym.config import NeMoGymBlock, NeMoGymServeConfig, load_serve_config
from gymckpt.integrations.nemo_gym.serving import NEMO_GYM_EXEMPT_PATHS, app, build_nemo_gym_app

__all__ = [
    "NEMO_GYM_EXEMPT_PATHS",
    "NeMoGymBlock",
    "NeMoGymServeConfig",
    "app",
    "build_nemo_gym_app",
    "load_serve_config",
]
