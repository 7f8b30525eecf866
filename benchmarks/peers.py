"""What a user might write instead of gymckpt, each durable (fsync) and exact for the workloads.

- ``naive``: pydantic validation of each record (a ``TypeAdapter(dict[str, Any])``),
  ``json.dumps`` per line, write, fsync; restore = ``json.loads`` per line + validation.
- ``sqlite``: WAL, ``synchronous=FULL``, one row per record (episode_id, ``json.dumps``
  text) in one transaction; restore = select all + ``json.loads``.
- ``pickle``: ``pickle.dump`` of the list of records, fsync; restore = ``pickle.load``.

``json.dumps`` writes NaN and integers of any size and ``json.loads`` reads them back
exactly, and pickle keeps every Python value, so each peer round-trips the workloads
(the driver checks it). Every restore keeps the decoded records in a list, GC enabled.
"""

from __future__ import annotations

import json
import os
import pickle
import sqlite3
from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["PEERS", "Peer"]

_RECORD = TypeAdapter(dict[str, Any])


class Peer:
    """One way of making records durable and reading them back."""

    name = ""
    label = ""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    @property
    def files(self) -> list[str]:
        """The files a commit leaves (for eviction and clean-up)."""
        raise NotImplementedError

    def commit(self, records: list[dict[str, Any]]) -> None:
        raise NotImplementedError

    def restore(self) -> list[dict[str, Any]]:
        raise NotImplementedError

    def clean(self) -> None:
        for path in self.files:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


class NaivePeer(Peer):
    name = "naive"
    label = "pydantic + json.dumps + fsync"

    @property
    def path(self) -> str:
        return os.path.join(self.directory, "naive.jsonl")

    @property
    def files(self) -> list[str]:
        return [self.path]

    def commit(self, records: list[dict[str, Any]]) -> None:
        validate = _RECORD.validate_python
        with open(self.path, "w", encoding="utf-8") as stream:
            for record in records:
                stream.write(json.dumps(validate(record)) + "\n")
            stream.flush()
            os.fsync(stream.fileno())

    def restore(self) -> list[dict[str, Any]]:
        validate = _RECORD.validate_python
        with open(self.path, encoding="utf-8") as stream:
            return [validate(json.loads(line)) for line in stream]


class SqlitePeer(Peer):
    name = "sqlite"
    label = "SQLite WAL, synchronous=FULL"

    @property
    def path(self) -> str:
        return os.path.join(self.directory, "peer.sqlite")

    @property
    def files(self) -> list[str]:
        return [self.path, self.path + "-wal", self.path + "-shm"]

    def commit(self, records: list[dict[str, Any]]) -> None:
        connection = sqlite3.connect(self.path, isolation_level=None)
        try:
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute("PRAGMA synchronous=FULL")
            connection.execute("CREATE TABLE records (episode_id TEXT PRIMARY KEY, body TEXT NOT NULL)")
            connection.execute("BEGIN")
            connection.executemany(
                "INSERT INTO records (episode_id, body) VALUES (?, ?)",
                ((record["episode_id"], json.dumps(record)) for record in records),
            )
            connection.execute("COMMIT")
        finally:
            connection.close()

    def restore(self) -> list[dict[str, Any]]:
        connection = sqlite3.connect(self.path, isolation_level=None)
        try:
            loads = json.loads
            return [loads(body) for (body,) in connection.execute("SELECT body FROM records ORDER BY rowid")]
        finally:
            connection.close()


class PicklePeer(Peer):
    name = "pickle"
    label = "pickle.dump + fsync"

    @property
    def path(self) -> str:
        return os.path.join(self.directory, "peer.pickle")

    @property
    def files(self) -> list[str]:
        return [self.path]

    def commit(self, records: list[dict[str, Any]]) -> None:
        with open(self.path, "wb") as stream:
            pickle.dump(records, stream, protocol=pickle.HIGHEST_PROTOCOL)
            stream.flush()
            os.fsync(stream.fileno())

    def restore(self) -> list[dict[str, Any]]:
        with open(self.path, "rb") as stream:
            return pickle.load(stream)


PEERS: dict[str, Callable[[str], Peer]] = {peer.name: peer for peer in (NaivePeer, SqlitePeer, PicklePeer)}
