"""The project's attack table: what an attacker with write access to a checkpoint directory, a port
or a socket can do, and the promise each attempt must leave intact.

- :data:`ATTACKS` (:mod:`~gymckpt.testing.attacks.store`): a checkpoint at rest, damaged one way;
  run by the backend suite on every backend.
- :data:`LIVE_ATTACKS` (:mod:`~gymckpt.testing.attacks.live`): attacks on a running system, each
  carried out by one named test.
"""

from gymckpt.testing.attacks.context import AttackContext, Expected
from gymckpt.testing.attacks.live import LIVE_ATTACKS, LiveAttack
from gymckpt.testing.attacks.store import ATTACKS, DOCUMENT_BUDGET, INDEX_LIMIT, MANIFEST_LIMIT, Attack

__all__ = [
    "ATTACKS",
    "DOCUMENT_BUDGET",
    "INDEX_LIMIT",
    "LIVE_ATTACKS",
    "MANIFEST_LIMIT",
    "Attack",
    "AttackContext",
    "Expected",
    "LiveAttack",
]
