"""Commit/restore benchmarks of the gymckpt store against the machine's primitives and peers.

Run with ``python -m benchmarks`` (or ``make bench``); ``--help`` lists the options.

Modules: :mod:`benchmarks.workloads` (the seeded W1/W2 record generators),
:mod:`benchmarks.primitives` (orjson, sha256, write+fsync, read, decode),
:mod:`benchmarks.peers` (pydantic+json, SQLite, pickle), :mod:`benchmarks.rss`
(peak memory in a fresh subprocess), :mod:`benchmarks.report` (tables and JSON) and
:mod:`benchmarks.__main__` (the driver).
"""
