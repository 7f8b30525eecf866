"""``gymckpt demo``: checkpoint in-flight rollouts, kill every server, restore, continue, verify.

- :mod:`gymckpt.demo.full`: the full demo (``run_demo``; ``make demo``). An uninterrupted
  run of the reference stack gives the results to reproduce; a fresh stack runs the same
  tasks, is checkpointed once half of them have finished, SIGKILLed, restarted and
  restored; every rollout continues or starts over, every result is compared with the
  uninterrupted run's, and the checkpoint is verified offline. The stack is driven
  through :class:`~gymckpt.stack.harness.RolloutHarness`.
- :mod:`gymckpt.demo.s3`: ``--store s3``, both demos against an S3 endpoint served by moto
  inside the demo process (``run_s3_demo``, ``run_s3_store_demo``); needs
  ``pip install -e '.[demo-s3]'`` in the gymckpt clone.
- :mod:`gymckpt.demo.ray_demo`: ``--ray``, the stack over a three-node Ray cluster on this
  machine, the node holding the environment and agent killed and recovered from (``run_ray_demo``).
- :mod:`gymckpt.demo.store_only`: ``--store-only``, the store alone: generated records of
  four participants written, published, verified and one scope restored, no servers.
- :mod:`gymckpt.demo.report`: what a run found (``DemoOutcome``), the comparison, the table.
- :mod:`gymckpt.demo.stacks`: the stacks of one demo run (start, watch, close), its logs
  directory and store root, and the one-line failure a phase raises (``PhaseFailed``).
- :mod:`gymckpt.demo.measure`: what the full demo reads back: where the exported rollouts
  stood, and the model calls a restore made again.

Exit status: 0 success, 1 a rollout lost, a result different or a damaged checkpoint (or a
phase failing after the rollouts started), 2 a setup failure (stack, store, embedded endpoint).
"""

from gymckpt.demo.full import run_demo
from gymckpt.demo.s3 import DEMO_BUCKET, run_s3_demo, run_s3_store_demo
from gymckpt.demo.store_only import run_store_demo

__all__ = ["DEMO_BUCKET", "run_demo", "run_s3_demo", "run_s3_store_demo", "run_store_demo"]
