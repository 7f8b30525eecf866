"""What tests of gymckpt, and of a storage backend or a server built on it, use.

- :class:`BackendTests` (``backend_suite``, needs pytest): the suite every backend runs, with
  the corruption table (``corruptions``) and the attack table (``attacks``).
- ``values``: records with the values that are easy to lose, and type-exact comparison.
- ``recording``: a backend that records what it was asked, and inotify over a directory.
- :class:`MotoEndpoint` (``moto``, needs ``moto[server]``): an S3 endpoint in this process.
- ``participant``: :class:`FakeParticipant`, a participant with controllable episodes.
- ``time`` and ``net``: a fake clock, bounded waits and polling; free ports, uvicorn in a thread.

It imports the store and the control plane; neither imports it. Import the submodules you need:
this package's ``__init__`` imports neither pytest nor moto.
"""

__all__: list[str] = []
