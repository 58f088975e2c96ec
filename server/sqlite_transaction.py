"""One write transaction on the server's metadata database (``BEGIN IMMEDIATE`` ... ``COMMIT``)."""

from __future__ import annotations

import sqlite3


class Transaction:
    """BEGIN IMMEDIATE ... COMMIT, rolled back on any exception."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type, exc, tb) -> None:
        self._db.execute("COMMIT" if exc_type is None else "ROLLBACK")
