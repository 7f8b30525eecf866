"""Several uvicorn workers per server: one checkpoint participant across them, and session routing.

``gymckpt serve KIND --workers N`` (:mod:`gymckpt.stack.serving`) makes the main process the
coordinator and starts N workers; :mod:`~gymckpt.workers.process` wires both sides.

- :mod:`~gymckpt.workers.frames`: 4-byte big-endian length + exact JSON frames, 1 GiB limit.
- :mod:`~gymckpt.workers.runtime`: the per-process socket directory (0700), socket paths
  (0600), stale-directory cleanup.
- :mod:`~gymckpt.workers.channel`: request/reply in both directions over one connection,
  immediate handlers, typed errors, 503 ``checkpoint_coordinator_unavailable`` when the peer is gone.
- :mod:`~gymckpt.workers.messages`: the message kinds, their bodies and timeouts.
- :mod:`~gymckpt.workers.coordinator`: :class:`~gymckpt.workers.coordinator.CoordinatedParticipant`,
  the participant the main process's control plane drives for N workers (merged, numbered
  readiness reports; fail closed on a missing or lost worker; broadcasts; restored
  whole-episode records held and claimed); its helpers in
  :mod:`~gymckpt.workers.coordinator_fields`.
- :mod:`~gymckpt.workers.coordinator_records`: its commit (one records file) and restore
  (sessions placed), with the records streamed in bounded chunks
  (:mod:`~gymckpt.workers.streams`, :mod:`~gymckpt.workers.scatter`): the coordinator never
  holds a participant's records.
- :mod:`~gymckpt.workers.worker_server`: the socket server the workers connect to.
- :mod:`~gymckpt.workers.gather` and :mod:`~gymckpt.workers.placement`: the pure parts of
  commit and restore across workers.
- :mod:`~gymckpt.workers.link`: a worker's side: registration, the handlers, reports, claims,
  and stopping itself when its coordinator is gone.
- :mod:`~gymckpt.workers.remote_plane`: what a worker's control routes call: every operation
  forwarded to the coordinator's plane.
- :mod:`~gymckpt.workers.routing`: signed session cookies naming a session's owning worker,
  and the router that forwards a request to its owner over a private Unix socket.
- :mod:`~gymckpt.workers.process`: the main process's coordinator thread, and what a
  worker process installs into its app.

Retire marks are copied to every worker (a snapshot when it registers, then each mark and
forget), so a retired attempt is ``stale_attempt`` on every worker until forget (the
reference's code does the same; its design text says no lasting fence is copied).
"""
