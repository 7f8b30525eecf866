"""``gymckpt collect``: rollout collection that survives preemption (R1).

:func:`collect` runs a dataset's rows through an environment server's ``/run``, writes
each reply to a results file as it arrives, checkpoints the rows in flight through the
coordination API (periodically, on SIGUSR1, and on SIGTERM before it exits), and with
``resume`` continues them from the newest published checkpoint. It fails loudly
(:mod:`gymckpt.collect.health`): a checkpoint directory a server refuses stops it before the
first row, and too few published checkpoints give :data:`EXIT_CHECKPOINTS_FAILED`.
"""

from gymckpt.collect.dataset import Row, load_rows
from gymckpt.collect.runner import (
    EXIT_CHECKPOINTS_FAILED,
    EXIT_FAILED_ROWS,
    EXIT_OK,
    EXIT_STOPPED,
    CollectOptions,
    CollectSummary,
    collect,
)

__all__ = [
    "EXIT_CHECKPOINTS_FAILED",
    "EXIT_FAILED_ROWS",
    "EXIT_OK",
    "EXIT_STOPPED",
    "CollectOptions",
    "CollectSummary",
    "Row",
    "collect",
    "load_rows",
]
