"""The store (gymckpt.store): its backends, the records codec and streams, crash consistency and
injected failures. ``crash_worker.py`` and ``unprivileged_commit.py`` are scripts the tests run by path."""
