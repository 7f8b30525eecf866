"""The control plane of one server and the controller's coordination.

- :mod:`gymckpt.control.participant`: the interface a server kind implements.
- :mod:`gymckpt.control.plane`: phases, fencing, the readiness wait, leases, storage (one per server).
- :mod:`gymckpt.control.routes`: the FastAPI routes under ``/ng-control/v1/checkpoint/``.
- :mod:`gymckpt.control.models`: their request and reply bodies.
- :mod:`gymckpt.control.responses`: the one error reply.
- :mod:`gymckpt.control.settings`: the ``checkpoint:`` settings block.
- :mod:`gymckpt.control.coordination`: the controller's side (discover, prepare, commit, publish, …).
"""
