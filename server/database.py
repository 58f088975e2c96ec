"""The metadata database behind the stores, in either engine: :class:`SqliteDatabase` (one file,
one server) or :class:`PostgresDatabase` (a connection pool, any number of server replicas).

The stores write their SQL once, in the dialect both engines share (``?`` and ``:name``
parameters, ``ON CONFLICT``); the PostgreSQL side rewrites the parameter marks for psycopg.
:meth:`Database.transaction` takes *lock keys*: under SQLite every write transaction is serial
already (``BEGIN IMMEDIATE``), under PostgreSQL each key is a transaction-level advisory lock,
so two replicas touching one owner's quota or replica take turns while different owners do not.
"""

from __future__ import annotations

import contextlib
import re
import sqlite3
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from functools import lru_cache
from typing import Any, Protocol

Params = Sequence[Any] | dict[str, Any]


class Rows(Protocol):
    """What a statement returns: a cursor-like result (rows read eagerly under PostgreSQL)."""

    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Any: ...
    def fetchall(self) -> list[Any]: ...
    def __iter__(self) -> Iterator[Any]: ...


class Database(Protocol):
    """What the stores need of a metadata database (either engine)."""

    def execute(self, sql: str, params: Params = ()) -> Rows: ...
    def executemany(self, sql: str, params: Sequence[Params]) -> None: ...
    def transaction(self, *locks: str) -> contextlib.AbstractContextManager[None]: ...
    def lock(self, key: str) -> None: ...
    def notify(self, payload: str) -> None: ...
    def grew(self, tables: tuple[str, ...], rows: int) -> None: ...
    def single_flight(self, name: str) -> contextlib.AbstractContextManager[bool]: ...
    def close(self) -> None: ...


class SqliteDatabase:
    """One SQLite connection (WAL), used by one server process on one event loop."""

    def __init__(self, connection: sqlite3.Connection) -> None:
        self._db = connection

    def execute(self, sql: str, params: Params = ()) -> sqlite3.Cursor:
        return self._db.execute(sql, params)

    def executemany(self, sql: str, params: Sequence[Params]) -> None:
        self._db.executemany(sql, params)

    @contextlib.contextmanager
    def transaction(self, *locks: str) -> Iterator[None]:
        """BEGIN IMMEDIATE ... COMMIT, rolled back on any exception; ``locks`` are implied (one writer at a time)."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def lock(self, key: str) -> None:
        """Implied by the transaction (SQLite has one writer at a time)."""

    def notify(self, payload: str) -> None:
        """Nothing to do: one process serves this database, and it knows what it just did."""

    def grew(self, tables: tuple[str, ...], rows: int) -> None:
        """Nothing to do: SQLite's planner picks the indexes without statistics."""

    @contextlib.contextmanager
    def single_flight(self, name: str) -> Iterator[bool]:
        yield True

    def close(self) -> None:
        self._db.close()


EVENTS_CHANNEL = "fctkit_events"
POOL_WAIT_S = 5.0  # the longest a statement waits for a pooled connection (the event loop waits with it)


class DatabaseUnreachable(Exception):
    """The replica knows the database is gone (its events connection dropped): calls fail at once
    instead of each waiting for the pool."""


def storage_unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` says the database or the object store cannot be reached (lost connection,
    pool exhausted, endpoint down): a call that meets it may succeed on retry, here or on another
    replica. Checked by name, so the embedded server needs neither driver installed."""
    names = {f"{cls.__module__}.{cls.__qualname__}" for cls in type(exc).__mro__}
    return isinstance(exc, DatabaseUnreachable) or bool(names & _UNREACHABLE)


_UNREACHABLE = {
    "psycopg.OperationalError",
    "psycopg_pool.PoolTimeout",
    "psycopg_pool.TooManyRequests",
    "botocore.exceptions.HTTPClientError",
    "botocore.exceptions.ConnectionError",
}


class _Result:
    def __init__(self, rows: list[Any], rowcount: int) -> None:
        self._rows, self.rowcount = rows, rowcount

    def fetchone(self) -> Any:
        return self._rows[0] if self._rows else None

    def fetchall(self) -> list[Any]:
        return list(self._rows)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._rows)


@lru_cache(maxsize=1024)
def psycopg_sql(sql: str) -> str:
    """The shared dialect's ``?`` and ``:name`` marks as psycopg's ``%s`` and ``%(name)s``."""
    sql = sql.replace("%", "%%").replace("?", "%s")
    return re.sub(r"(?<![:\w]):([A-Za-z_]\w*)", r"%(\1)s", sql)


_PLAIN_INSERT = re.compile(r"\s*INSERT INTO (\w+(?: \([\w, ]+\))?) VALUES \((?:\?, )*\?\)\s*")


def _copy_target(sql: str) -> str | None:
    """``table (columns)`` of a plain multi-row INSERT (no ON CONFLICT, no expressions), else None."""
    match = _PLAIN_INSERT.fullmatch(sql)
    return match.group(1) if match else None


class PostgresDatabase:
    """A psycopg connection pool. Statements outside a transaction run in autocommit on any
    pooled connection; :meth:`transaction` pins one connection (a context variable) until it ends."""

    def __init__(self, dsn: str, *, max_connections: int = 20) -> None:
        from psycopg_pool import ConnectionPool

        self._pool = ConnectionPool(
            dsn,
            min_size=1,
            max_size=max_connections,
            kwargs={"autocommit": True, "connect_timeout": 5},
            open=True,
            timeout=POOL_WAIT_S,
            name="fctkit",
        )
        self._pool.wait(timeout=30.0)
        self._current: ContextVar[Any] = ContextVar(f"fctkit-pg-{id(self)}", default=None)
        self._growth: dict[tuple[str, ...], list[int]] = {}  # tables -> [rows added since ANALYZE, rows at it]
        self.round_trips = 0  # statements and transaction ends sent (executemany pipelines count once)
        self.reachable = True  # False while the events connection is down (set by the replica)

    def _run(self, connection: Any, sql: str, params: Params) -> _Result:
        self.round_trips += 1
        cursor = connection.execute(psycopg_sql(sql), params or None)
        return _Result(cursor.fetchall() if cursor.description else [], cursor.rowcount)

    def execute(self, sql: str, params: Params = ()) -> _Result:
        with self._connection() as connection:
            return self._run(connection, sql, params)

    def executemany(self, sql: str, params: Sequence[Params]) -> None:
        """Plain ``INSERT INTO t [(columns)] VALUES (?, ...)`` rows go in with COPY (a bulk stream,
        several times faster than one statement per row); anything else as a pipelined executemany."""
        if not params:
            return
        self.round_trips += 1
        with self._connection() as connection, connection.cursor() as cursor:
            if (target := _copy_target(sql)) is not None:
                with cursor.copy(f"COPY {target} FROM STDIN") as copy:
                    for row in params:
                        copy.write_row(row)
            else:
                cursor.executemany(psycopg_sql(sql), params)

    @contextlib.contextmanager
    def _connection(self) -> Iterator[Any]:
        current = self._current.get()
        if current is not None:
            yield current
            return
        with self._pooled() as connection:
            yield connection

    def _pooled(self) -> contextlib.AbstractContextManager[Any]:
        if not self.reachable:
            raise DatabaseUnreachable("the database is unreachable (this replica's events connection is down)")
        return self._pool.connection()

    @contextlib.contextmanager
    def transaction(self, *locks: str) -> Iterator[None]:
        """BEGIN ... COMMIT on one pooled connection, holding an advisory lock per key (taken in
        sorted order, so two transactions never wait on each other's keys crosswise)."""
        self.round_trips += 2  # BEGIN, COMMIT
        with self._pooled() as connection, connection.transaction():
            token = self._current.set(connection)
            try:
                for key in sorted(set(locks)):
                    self.lock(key)
                yield
            finally:
                self._current.reset(token)

    def lock(self, key: str) -> None:
        """Inside a transaction: wait for ``key``'s advisory lock, held until the transaction ends."""
        self.execute("SELECT pg_advisory_xact_lock(hashtextextended(?, 0))", (key,))

    def notify(self, payload: str) -> None:
        """Tell every replica (delivered when the current transaction commits)."""
        self.execute("SELECT pg_notify(?, ?)", (EVENTS_CHANNEL, payload))

    def grew(self, tables: tuple[str, ...], rows: int) -> None:
        """``rows`` were just added to ``tables``: refresh their statistics once they grew by a fifth
        (at least 1,000 rows). Autovacuum does it too, but only every minute or so, and a planner
        that still believes a table is empty picks nested loops that scan it once per row: a
        replica that grows from nothing to 10,000 rows in seconds would see compaction queries
        take minutes instead of milliseconds."""
        added, at_last = self._growth.setdefault(tables, [0, 0])
        added += rows
        if added >= max(1000, at_last // 5):
            self.execute(f"ANALYZE {', '.join(tables)}")
            self._growth[tables] = [0, at_last + added]
        else:
            self._growth[tables][0] = added

    @contextlib.contextmanager
    def single_flight(self, name: str) -> Iterator[bool]:
        """True for the one replica that holds ``name``'s session lock now; False for the others.
        A replica that dies loses the lock with its connection."""
        with self._pooled() as connection:
            held = connection.execute("SELECT pg_try_advisory_lock(hashtextextended(%s, 1))", (name,)).fetchone()[0]
            try:
                yield bool(held)
            finally:
                if held:
                    connection.execute("SELECT pg_advisory_unlock(hashtextextended(%s, 1))", (name,))

    def close(self) -> None:
        self._pool.close()


def add_columns(columns: Sequence[tuple[str, str, str]], present: dict[str, set[str]] | None = None) -> str:
    """The statements adding those of ``columns`` (table, column, type) a table lacks (``present``:
    table → its columns, as SQLite lists them); None: PostgreSQL's ``ADD COLUMN IF NOT EXISTS`` decides."""
    guard = "IF NOT EXISTS " if present is None else ""
    return ";\n".join(
        f"ALTER TABLE {table} ADD COLUMN {guard}{column} {kind}"
        for table, column, kind in columns
        if column not in (present or {}).get(table, set())
    )
