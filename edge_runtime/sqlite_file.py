"""The gallery's SQLite file: connections, transactions, and a damaged file as a kit error.

Every statement on a gallery connection goes through :class:`GuardedConnection`: an SQLite
error other than a constraint violation (a page SQLite cannot parse, a table or index a flipped
byte made unreadable, an I/O error) becomes a :class:`GalleryDamagedError` that names the file
and says what to do, never a bare ``sqlite3.DatabaseError`` traceback. Constraint violations
stay ``sqlite3.IntegrityError``: callers turn them into their own messages (a duplicate id).
"""

from __future__ import annotations

import errno
import os
import shutil
import sqlite3
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import cast

from fctkit.errors import GalleryDamagedError, NoSpaceError

PAGE_SIZE = 16384  # a row's two sealed 128-d vectors are ~1.1 KB: several rows per page

RECOVERY = (
    "run `fctkit device check --dir DIR` for a full report and `fctkit device repair --dir DIR` to restore "
    "what the owner's replica holds"
)


LOW_SPACE = (
    1 << 20
)  # an SQLite I/O error with less free than this is the full disk (its shared-memory file cannot grow)


def damaged(path: Path | str, exc: sqlite3.Error) -> GalleryDamagedError | NoSpaceError:
    code = getattr(exc, "sqlite_errorcode", 0) & 0xFF  # the primary code of an extended one (SQLITE_IOERR_SHMSIZE)
    if code == sqlite3.SQLITE_FULL or (code == sqlite3.SQLITE_IOERR and _free(Path(path).parent) < LOW_SPACE):
        return no_space(Path(path).parent, f"SQLite says {exc}")
    if isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc):
        return GalleryDamagedError(f"{path} is locked by another process for too long ({exc}); try again")
    return GalleryDamagedError(f"{path} cannot be read: SQLite says {exc!r}; the file is damaged. {RECOVERY}")


def no_space(directory: Path, detail: str, needed: int | None = None) -> NoSpaceError:
    """A full disk, said as such: the directory, and how much is needed when that is known."""
    need = f"{needed:,} bytes are needed, " if needed is not None else ""
    return NoSpaceError(
        f"no space left on device for {directory} ({detail}): {need}{_free(directory):,} bytes are free; "
        "free some space and run the command again (what it was writing was undone)"
    )


def _free(directory: Path) -> int:
    try:
        return shutil.disk_usage(directory).free
    except OSError:  # unreadable: not taken for a full disk
        return LOW_SPACE


def require_room(directory: Path, needed: int, what: str) -> None:
    """Refuse, before anything is written, when ``directory``'s disk has less than ``needed`` bytes free."""
    if _free(directory) < needed:
        raise no_space(directory, what, needed)


def file_bytes(path: Path) -> int:
    """The bytes an SQLite file takes with its write-ahead log."""
    return sum(p.stat().st_size for p in (path, path.with_name(path.name + "-wal")) if p.is_file())


def is_no_space(exc: BaseException) -> bool:
    """Whether an OSError (or shutil.Error, which lists its files' errors as text) is ENOSPC."""
    return isinstance(exc, OSError) and (exc.errno == errno.ENOSPC or os.strerror(errno.ENOSPC) in str(exc))


class _GuardedCursor(sqlite3.Cursor):
    """A cursor whose SQLite errors (but constraint violations) are :class:`GalleryDamagedError`."""

    def _guard(self, call, *args):
        try:
            return call(*args)
        except sqlite3.IntegrityError:
            raise
        except sqlite3.Error as exc:
            raise damaged(cast(GuardedConnection, self.connection).path, exc) from None

    def execute(self, sql, parameters=()):
        return self._guard(super().execute, sql, parameters)

    def executemany(self, sql, seq_of_parameters):
        return self._guard(super().executemany, sql, seq_of_parameters)

    def fetchone(self):
        return self._guard(super().fetchone)

    def fetchmany(self, size=1):
        return self._guard(super().fetchmany, size)

    def fetchall(self):
        return self._guard(super().fetchall)

    def __next__(self):
        return self._guard(super().__next__)


class GuardedConnection(sqlite3.Connection):
    """An SQLite connection whose statements run on :class:`_GuardedCursor`."""

    path: Path

    def execute(self, sql, parameters=()):
        return self.cursor(_GuardedCursor).execute(sql, parameters)

    def executemany(self, sql, seq_of_parameters):
        return self.cursor(_GuardedCursor).executemany(sql, seq_of_parameters)


def connect(path: Path, *, new: bool = False) -> GuardedConnection:
    """A connection in autocommit mode (transactions are explicit: :class:`transaction`), WAL,
    fsync'd commits; plaintext columns are read back byte for byte, so a damaged one is a row
    that fails its authentication, not a decoding error that stops every query."""
    try:
        db = sqlite3.connect(
            path, isolation_level=None, timeout=60.0, check_same_thread=False, factory=GuardedConnection
        )
    except sqlite3.Error as exc:
        raise damaged(path, exc) from None
    db.path = path
    db.text_factory = lambda data: data.decode("utf-8", "surrogateescape")
    try:
        if new:
            db.execute(f"PRAGMA page_size={PAGE_SIZE}")
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
    except BaseException:  # a file SQLite cannot read: closed now, not by the garbage collector later
        db.close()
        raise
    return db


SQL_VARIABLES = 500  # ids per `IN (...)` query


class transaction:
    """BEGIN IMMEDIATE … COMMIT (ROLLBACK on any error): one atomic write."""

    begin = "BEGIN IMMEDIATE"

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> sqlite3.Connection:
        self.db.execute(self.begin)
        return self.db

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            try:
                self.db.execute("COMMIT")
            except BaseException:  # e.g. a full disk: the transaction is undone, not left open
                if self.db.in_transaction:
                    self.db.execute("ROLLBACK")
                raise
        elif self.db.in_transaction:  # SQLite may have rolled back already (a damaged page)
            self.db.execute("ROLLBACK")
        if exc_type is not None and issubclass(exc_type, sqlite3.IntegrityError):
            # a constraint no caller turned into its own message: a table and its index disagree
            raise GalleryDamagedError(
                f"{getattr(self.db, 'path', 'the gallery')} refused a write: SQLite says {exc!r}; a "
                f"table and its index disagree, so the file is damaged (nothing was written). {RECOVERY}"
            ) from None


class read_snapshot(transaction):
    """BEGIN DEFERRED … COMMIT: reads that see one consistent snapshot."""

    begin = "BEGIN DEFERRED"


def text_match(column: str, value: str) -> tuple[str, str | bytes]:
    """An SQL condition and its parameter matching ``column`` to ``value`` as read back from the
    file: a text that is not valid UTF-8 (read with surrogateescape, as a damaged byte leaves it)
    cannot be bound as text, so it is compared as the raw bytes it was read from."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return f"CAST({column} AS BLOB) = ?", value.encode("utf-8", "surrogateescape")
    return f"{column} = ?", value


def id_chunks(item_ids: Sequence) -> Iterator[tuple[list, str]]:
    """Ids (item ids or row ids) in chunks small enough for one ``IN (...)`` query, each with its ``?,?`` marks."""
    for start in range(0, len(item_ids), SQL_VARIABLES):
        chunk = list(item_ids[start : start + SQL_VARIABLES])
        yield chunk, ",".join("?" * len(chunk))
