"""gymckpt: partial-rollout checkpointing for reinforcement-learning environment servers."""

from gymckpt._version import __version__

__all__ = ["__version__"]
