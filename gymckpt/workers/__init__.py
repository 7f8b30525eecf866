"""Several uvicorn workers per server: one participant across them (being built; until it is
wired in, a server with checkpointing on refuses to start as one of several workers).

What exists so far, used by no server yet:

- :mod:`~gymckpt.workers.frames`: 4-byte big-endian length + exact JSON frames, 1 GiB limit.
- :mod:`~gymckpt.workers.runtime`: the per-process socket directory (0700), socket paths
  (0600), stale-directory cleanup.
- :mod:`~gymckpt.workers.channel`: request/reply in both directions over one connection,
  immediate handlers, typed errors, 503 ``checkpoint_coordinator_unavailable`` when the peer is gone.
- :mod:`~gymckpt.workers.gather` and :mod:`~gymckpt.workers.placement`: the pure parts of
  commit and restore across workers.
"""
