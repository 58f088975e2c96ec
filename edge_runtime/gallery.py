"""The encrypted on-device gallery: one SQLite file (WAL) of sealed rows.

Row format::

    items       row_id INTEGER PRIMARY KEY  stable for the row's life; part of every record's AAD
                item_id TEXT UNIQUE         the app's id for the item (plaintext: use opaque ids)
                origin_version INTEGER      the model version that embedded the item's image
                label BLOB NULL             sealed UTF-8 label
                vault_sha256 TEXT NULL      the encrypted original in the server's vault, once uploaded
                                            (a replicated row: the original another device uploaded)
                record_sha256 TEXT NULL     the replica record this row's content is (pulled, or sealed
                                            for pushing); NULL: a local change not sealed yet
    vectors_0 / row_id INTEGER PRIMARY KEY
    vectors_1   version INTEGER             the version whose query space the vectors live in
                via TEXT                    how they got there: 'native' (embedded by that version's
                                            model), 'forward' (adapted by h/F from origin_version),
                                            'backward' (B(φ_new), unified mode)
                embedding BLOB, side_info BLOB   sealed float32 vectors (side-info empty when none)

Replication (schema 2, :mod:`fctkit.edge_runtime.replication`)::

    changes          change_id INTEGER PRIMARY KEY AUTOINCREMENT   the outbox of rows to push; the
                     item_id, tombstone, then once sealed: version,  id is the push's idempotency key
                     origin_version, via, sealed (the owner-key record)
    tombstones       item_id, vault_sha256       removed items (their ids are never used again); for a
                                                 removal made here, the original to delete from the
                                                 vault once the tombstone is pushed
    pending_records  sequence, item_id, version, origin_version, via, sealed
                                                 pulled records of a version not installed yet
    meta.replica_cursor                          the owner's last sequence number merged

Every write that changes a live row logs a change in the same transaction (adding, the
switch commit of an upgrade, in-place upgrades and backfills, removal as a tombstone); one
unsealed change per item is kept. Schema 1 galleries are migrated when opened: every row
gets a change, so the whole gallery is pushed once.

One of the two vector tables is live (``meta.live_vectors``); a forward-mode upgrade writes
the new vectors into the other one and the switch commit flips them in one transaction, so
queries see complete old vectors until then and the table swap rewrites nothing.

The version tag (origin_version, version, via) says exactly which space a row is in, so a
backfilled row (native at v) and an adapted one (forward from u to v) can sit side by side,
and a replicated row is compared only once the device has its version (until then it waits
in ``pending_records``).

Every record is sealed with AES-256-GCM under the device key; its authenticated data is
``gallery id | row id | item id | origin | version | via | field``. A modified, truncated,
swapped or replayed record fails to open and is reported as corrupt; the other rows load.

Settings (schema 4, :mod:`fctkit.edge_runtime.gallery_settings`): every ``meta`` row carries an
HMAC under the device key, so a damaged query version, live table, cursor or upgrade state is
named, never used; ``meta.row_count`` (authenticated, moved in the transaction of every add and
removal) makes a row gone from the file a reported loss, not a shorter answer. SQLite errors on a
damaged file are :class:`GalleryDamagedError` (:mod:`fctkit.edge_runtime.sqlite_file`).
"""

from __future__ import annotations

import base64
import json
import os
import sqlite3
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fctkit.errors import CorruptRecordError, DeviceKeyError, GalleryDamagedError, GalleryError, InputError

from .crypto import Sealer
from .gallery_settings import ESSENTIAL, GallerySettings, add_macs, authentic
from .sqlite_file import connect
from .sqlite_file import read_snapshot as _read_snapshot
from .sqlite_file import transaction as _transaction

SCHEMA_VERSION = 4
VIAS = ("native", "forward", "backward")
VECTOR_TABLES = ("vectors_0", "vectors_1")
_KEY_CHECK = b"fctkit-gallery-key-check"

_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL, mac BLOB);
CREATE TABLE items (
    row_id INTEGER PRIMARY KEY,
    item_id TEXT NOT NULL UNIQUE,
    origin_version INTEGER NOT NULL,
    label BLOB,
    vault_sha256 TEXT,
    record_sha256 TEXT
);
CREATE TABLE vectors_0 (row_id INTEGER PRIMARY KEY, version INTEGER NOT NULL, via TEXT NOT NULL,
                        embedding BLOB NOT NULL, side_info BLOB NOT NULL);
CREATE TABLE vectors_1 (row_id INTEGER PRIMARY KEY, version INTEGER NOT NULL, via TEXT NOT NULL,
                        embedding BLOB NOT NULL, side_info BLOB NOT NULL);
CREATE TABLE outbox (item_id TEXT PRIMARY KEY, blob BLOB NOT NULL);
"""
_REPLICATION_SCHEMA = """
CREATE TABLE changes (change_id INTEGER PRIMARY KEY AUTOINCREMENT, item_id TEXT NOT NULL, tombstone INTEGER NOT NULL,
                      version INTEGER, origin_version INTEGER, via TEXT, sealed BLOB);
CREATE INDEX changes_by_item ON changes (item_id);
CREATE TABLE tombstones (item_id TEXT PRIMARY KEY, vault_sha256 TEXT);
CREATE TABLE pending_records (sequence INTEGER PRIMARY KEY, item_id TEXT NOT NULL, version INTEGER NOT NULL,
                              origin_version INTEGER NOT NULL, via TEXT NOT NULL, sealed BLOB NOT NULL);
"""
_EXTRAS_SCHEMA = """
CREATE TABLE IF NOT EXISTS row_extras (row_id INTEGER NOT NULL, field TEXT NOT NULL, origin_version INTEGER NOT NULL,
                         version INTEGER NOT NULL, via TEXT NOT NULL, sealed BLOB NOT NULL, PRIMARY KEY (row_id, field));
"""
_SCHEMA += _REPLICATION_SCHEMA + _EXTRAS_SCHEMA
#: per-row extras (schema 3): the row's embedding in the previous version's space while a
#: transition lasts (sealed as that tag's "embedding", so it is the very record the row had),
#: and the row's hubness offset in its current space
EXTRA_FIELDS = {"previous_embedding": "embedding", "hubness_offset": "hubness_offset"}
_SQL_VARIABLES = 500  # item ids per `IN (...)` query

@dataclass(frozen=True)
class VersionTag:
    """Which space a row's vectors are in (see the module docstring)."""

    origin_version: int
    version: int
    via: str

    def __post_init__(self) -> None:
        if self.via not in VIAS:
            raise GalleryError(f"version tag via={self.via!r} is not one of {', '.join(VIAS)}")

    def __str__(self) -> str:
        if self.via == "native":
            return f"v{self.version}"
        if self.origin_version == self.version:
            return f"v{self.version} ({self.via})"
        return f"v{self.origin_version}->v{self.version} ({self.via})"


@dataclass(frozen=True)
class NewRow:
    item_id: str
    embedding: np.ndarray
    side_info: np.ndarray
    label: str | None = None


@dataclass
class LoadedRows:
    """The decrypted gallery (the rows that opened) and the rows that did not."""

    row_ids: np.ndarray
    item_ids: list[str]
    tags: list[VersionTag]
    embeddings: np.ndarray
    side_infos: np.ndarray
    labels: list[str | None]
    corrupt: list[tuple[int, str, str]] = field(default_factory=list)  # (row id, item id, reason)
    missing: int = 0  # rows the authenticated row count has but the file no longer holds

    def __len__(self) -> int:
        return len(self.item_ids)

    def subset(self, keep: Sequence[int]) -> LoadedRows:
        """The rows at positions ``keep`` (damage counts unchanged)."""
        return LoadedRows(
            row_ids=self.row_ids[list(keep)], item_ids=[self.item_ids[i] for i in keep], tags=[self.tags[i] for i in keep],
            embeddings=take_rows(self.embeddings, keep), side_infos=self.side_infos[list(keep)],
            labels=[self.labels[i] for i in keep], corrupt=self.corrupt, missing=self.missing,
        )


@dataclass(frozen=True)
class ItemState:
    """An item's replication state: its live tag (None: no row), the record its content is
    (None: an unsealed local change) and whether it was removed."""

    tag: VersionTag | None
    record_sha256: str | None
    tombstoned: bool


@dataclass(frozen=True)
class ReplicaWrite:
    """What merging one record does (see :meth:`Gallery.merge_replica`): ``kind`` 'row' (replace
    the item's row; ``record_sha256`` None logs it as a local change to push), 'tombstone',
    'pending' (keep ``sealed`` for a version not installed yet) or 'ignore'."""

    kind: str
    item_id: str
    tag: VersionTag | None = None
    embedding: np.ndarray | None = None
    side_info: np.ndarray | None = None
    label: str | None = None
    vault_sha256: str | None = None
    record_sha256: str | None = None
    sequence: int = 0
    sealed: bytes = b""


@dataclass(frozen=True)
class SealedChange:
    """A change sealed for pushing: ``tag`` is the row state it was sealed from (None: tombstone)."""

    change_id: int
    item_id: str
    tag: VersionTag | None
    sealed: bytes
    sha256: str


@dataclass(frozen=True)
class UpgradedRows:
    """New vectors for a batch of rows, all computed from the same (guarded) tag."""

    row_ids: Sequence[int]
    item_ids: Sequence[str]
    old_tag: VersionTag
    new_tag: VersionTag
    embeddings: np.ndarray
    side_infos: np.ndarray


def _aad(gallery_id: bytes, row_id: int, item_id: str, tag: VersionTag, field_name: str) -> bytes:
    if not isinstance(item_id, str) or not isinstance(row_id, int):  # a damaged plaintext column read back as another type
        raise CorruptRecordError(f"row {row_id!r}: its row id or item id is damaged ({item_id!r})")
    return b"fctkit-gallery/1|%s|%d|%s|%d|%d|%s|%s" % (
        gallery_id, row_id, item_id.encode("utf-8", "surrogateescape"), tag.origin_version, tag.version, tag.via.encode(),
        field_name.encode())


def _label_tag(origin_version: int) -> VersionTag:
    # labels never change across versions: bound to the row and its origin only
    return VersionTag(origin_version, origin_version, "native")


class Gallery:
    """An encrypted gallery file. Open with :meth:`create` (new) or :meth:`open` (existing).

    Readers and one writer may use the file at the same time (WAL): a query sees one
    consistent snapshot; each write is one transaction."""

    def __init__(self, path: Path, connection: sqlite3.Connection, sealer: Sealer, gallery_id: bytes) -> None:
        self.path = path
        self._db = connection
        self._sealer = sealer
        self.gallery_id = gallery_id
        self.settings = GallerySettings(connection, sealer, path)

    # -- opening ---------------------------------------------------------------------------

    @classmethod
    def create(cls, path: str | os.PathLike, key: bytes) -> Gallery:
        path = Path(path)
        if path.exists():
            raise GalleryError(f"{path} already exists: open it instead, or move it away to start a new gallery")
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        db = connect(path, new=True)
        gallery_id = os.urandom(16)
        sealer = Sealer(key)
        check = sealer.seal(_KEY_CHECK, b"key-check|" + gallery_id)
        with _transaction(db):
            for statement in filter(str.strip, _SCHEMA.split(";")):
                db.execute(statement)
            GallerySettings(db, sealer, path).put({
                "schema_version": str(SCHEMA_VERSION), "gallery_id": gallery_id.hex(),
                "key_check": base64.b64encode(check).decode(), "query_version": "0",
                "live_vectors": VECTOR_TABLES[0], "replica_cursor": "0", "row_count": "0",
            })
        return cls(path, db, sealer, gallery_id)

    @classmethod
    def open(cls, path: str | os.PathLike, key: bytes) -> Gallery:
        """Open an existing gallery (migrating an older schema); a key that is not the gallery's
        raises :class:`DeviceKeyError` and damaged essential settings :class:`GalleryDamagedError`,
        both before anything is written."""
        path = Path(path)
        if not path.is_file():
            raise GalleryError(f"gallery {path} does not exist: run `fctkit device init` first")
        db = connect(path)
        try:
            return cls._opened(path, db, Sealer(key))
        except BaseException:
            db.close()
            raise

    @classmethod
    def _opened(cls, path: Path, db: sqlite3.Connection, sealer: Sealer) -> Gallery:
        try:
            columns = {row[1] for row in db.execute("PRAGMA table_info(meta)")}
            mac_column = "mac" if "mac" in columns else "NULL"
            meta = {k: (v, m) for k, v, m in db.execute(f"SELECT key, value, {mac_column} FROM meta")}
        except GalleryDamagedError as exc:
            raise GalleryDamagedError(f"{path} is not an fctkit gallery or is damaged beyond its records ({exc})") from None
        if "mac" in columns:
            _check_essential(path, db, sealer, meta)
        schema = meta.get("schema_version", (None, None))[0]
        if schema not in ("1", "2", "3", str(SCHEMA_VERSION)) or "gallery_id" not in meta:
            raise GalleryError(f"{path}: unsupported gallery schema {schema!r} (this fctkit reads {SCHEMA_VERSION})")
        try:
            gallery_id = bytes.fromhex(meta["gallery_id"][0])
            sealer.open(base64.b64decode(meta["key_check"][0]), b"key-check|" + gallery_id, "key check")
        except (CorruptRecordError, ValueError, KeyError):
            raise DeviceKeyError(
                f"{path} was not sealed with this device key: use the gallery's own key file (nothing was changed)"
            ) from None
        for migrate in (_add_replication, _add_row_extras, _add_macs):
            migrate(db, sealer)
        return cls(path, db, sealer, gallery_id)

    def reader(self) -> Gallery:
        """A second connection to the same gallery (for a thread that reads while this one writes)."""
        return Gallery(self.path, connect(self.path), self._sealer, self.gallery_id)

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Gallery:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- metadata --------------------------------------------------------------------------

    def meta(self, key: str, default: str | None = None) -> str | None:
        """An authenticated setting (:mod:`.gallery_settings`); a damaged one raises :class:`GalleryDamagedError`."""
        return self.settings.get(key, default)

    def set_meta(self, values: dict[str, str | None]) -> None:
        with _transaction(self._db):
            self._set_meta(values)

    def _set_meta(self, values: dict[str, str | None]) -> None:
        self.settings.put(values)

    def _count_rows(self, added: int) -> None:
        """Inside a write transaction: the authenticated row count moves with every row added or removed."""
        if added:
            self._set_meta({"row_count": str(int(self.meta("row_count")) + added)})

    def recount_rows(self) -> int:
        """Take the row count afresh from the file (repair, after damage was dealt with)."""
        with _transaction(self._db):
            count = self._db.execute("SELECT COUNT(*) FROM items").fetchone()[0]
            self._set_meta({"row_count": str(count)})
        return count

    @property
    def query_version(self) -> int:
        """The installed version whose query model answers queries (0: none yet)."""
        return int(self.meta("query_version", "0"))

    @property
    def upgrade_state(self) -> dict[str, Any] | None:
        """The upgrade in progress (target, mode, hops) or None."""
        text = self.meta("upgrade")
        return json.loads(text) if text else None

    def change_marker(self) -> tuple[int, int]:
        """Changes whenever this or another connection commits a write (cache key for searches)."""
        return self._db.execute("PRAGMA data_version").fetchone()[0], self._db.total_changes

    def _tables(self) -> tuple[str, str]:
        """(live, staged) vector tables; read inside the caller's transaction."""
        live = self.meta("live_vectors")
        if live not in VECTOR_TABLES:
            raise GalleryError(f"{self.path}: meta.live_vectors is {live!r}; the gallery is damaged")
        return live, VECTOR_TABLES[1 - VECTOR_TABLES.index(live)]

    def __len__(self) -> int:
        return self._db.execute("SELECT COUNT(*) FROM items").fetchone()[0]

    def tag_counts(self) -> dict[str, int]:
        """How many rows are in each space (``str(VersionTag)``), staged rows counted at their next tag."""
        with _read_snapshot(self._db):
            live, staged = self._tables()
            query = (f"SELECT i.origin_version, COALESCE(s.version, v.version), COALESCE(s.via, v.via), COUNT(*) "
                     f"FROM items i JOIN {live} v USING (row_id) LEFT JOIN {staged} s USING (row_id) GROUP BY 1, 2, 3")
            rows = self._db.execute(query).fetchall()
        return {_tag_name(o, v, via): n for o, v, via, n in rows}

    # -- rows ------------------------------------------------------------------------------

    def add_rows(self, rows: Sequence[NewRow], tag: VersionTag, outbox: Sequence[tuple[str, bytes]] = (), *,
                 query_version: int | None = None, previous: tuple[VersionTag, np.ndarray] | None = None) -> list[int]:
        """Insert rows (and their queued vault uploads) in one transaction; returns the row ids.
        An item id already in the gallery is an error, and so is a ``query_version`` that is no
        longer the gallery's (another process switched it meanwhile): nothing is written.
        ``previous``: the rows' embeddings in the previous version's space (a transition)."""
        with _transaction(self._db):
            if query_version is not None and self.query_version != query_version:
                raise GalleryError(
                    f"the gallery switched to v{self.query_version} while these rows were embedded with v{query_version}: add them again")
            live, _ = self._tables()
            first = self._db.execute("SELECT COALESCE(MAX(row_id), 0) + 1 FROM items").fetchone()[0]
            ids = list(range(first, first + len(rows)))
            items, vectors = [], []
            for row_id, row in zip(ids, rows, strict=True):
                embedding, side_info = self._seal_vectors(row_id, row.item_id, tag, row.embedding, row.side_info)
                label = None if row.label is None else self._sealer.seal(
                    row.label.encode("utf-8"), _aad(self.gallery_id, row_id, row.item_id, _label_tag(tag.origin_version), "label"))
                items.append((row_id, row.item_id, tag.origin_version, label))
                vectors.append((row_id, tag.version, tag.via, embedding, side_info))
            try:
                self._db.executemany("INSERT INTO items (row_id, item_id, origin_version, label) VALUES (?, ?, ?, ?)", items)
            except sqlite3.IntegrityError:
                raise InputError("an item id is already in the gallery: item ids are unique (nothing was added)") from None
            removed = self._tombstoned([row.item_id for row in rows])
            if removed:
                raise InputError(f"item id {removed[0]!r} was removed before: removed ids are never used again "
                                 "(the removal replicates to the owner's devices); choose new ids (nothing was added)")
            self._db.executemany(f"INSERT INTO {live} VALUES (?, ?, ?, ?, ?)", vectors)
            self._db.executemany("INSERT INTO outbox VALUES (?, ?)", outbox)
            self._count_rows(len(rows))
            self._log_changes([row.item_id for row in rows])
            if previous is not None:
                self._insert_extras("previous_embedding", ids, [row.item_id for row in rows], previous[0], previous[1])
        return ids

    def _seal_vectors(self, row_id: int, item_id: str, tag: VersionTag, embedding: np.ndarray, side_info: np.ndarray) -> tuple[bytes, bytes]:
        (embedding,), (side_info,) = self._seal_block([row_id], [item_id], tag, embedding[None], side_info[None])
        return embedding, side_info

    def _seal_block(self, row_ids: Sequence[int], item_ids: Sequence[str], tag: VersionTag,
                    embeddings: np.ndarray, side_infos: np.ndarray) -> tuple[list[bytes], list[bytes]]:
        """Sealed records of each row's embedding and side-info."""
        sealed = []
        for name, block in (("embedding", embeddings), ("side_info", side_infos)):
            block = np.ascontiguousarray(block, dtype="<f4").reshape(len(row_ids), -1)
            raw, width = block.tobytes(), block.shape[1] * 4
            plaintexts = [raw[i * width:(i + 1) * width] for i in range(len(row_ids))]
            aads = [_aad(self.gallery_id, r, i, tag, name) for r, i in zip(row_ids, item_ids, strict=True)]
            sealed.append(self._sealer.seal_many(plaintexts, aads))
        return sealed[0], sealed[1]

    def load(self, *, with_labels: bool = True) -> LoadedRows:
        """Decrypt every row into memory in one consistent snapshot. Rows that fail to open
        are listed in ``corrupt`` (row id, item id, reason); the others load."""
        with _read_snapshot(self._db):
            live, _ = self._tables()
            expected = int(self.meta("row_count"))
            cursor = self._db.execute(  # an item whose vectors are gone is a damaged row, not a silently shorter answer
                f"SELECT row_id, i.item_id, i.origin_version, v.version, v.via, v.embedding, v.side_info, i.label "
                f"FROM items i LEFT JOIN {live} v USING (row_id) ORDER BY row_id")
            loaded = self._decrypt_rows(cursor, with_labels=with_labels)
        loaded.missing = max(0, expected - len(loaded) - len(loaded.corrupt))
        return loaded

    def _decrypt_rows(self, cursor: Iterable[tuple], *, with_labels: bool,
                      fields: tuple[str, str | None] = ("embedding", "side_info")) -> LoadedRows:
        """Open the (row id, item id, origin, version, via, first, second, label) records of
        ``cursor``; ``fields`` names the AAD fields of the first and second sealed values (the
        second None: there is none)."""
        first_field, second_field = fields
        row_ids, item_ids, tags, embeddings, side_infos, labels, corrupt = [], [], [], [], [], [], []
        gid, open_ = self.gallery_id, self._sealer.open
        known_tags: dict[tuple, VersionTag] = {}
        for row_id, item_id, origin, version, via, emb, side, label in cursor:
            tag = known_tags.get((origin, version, via))
            try:
                if emb is None:
                    raise CorruptRecordError(f"row {row_id}: its vectors are missing from the gallery file")
                if tag is None:
                    tag = known_tags[(origin, version, via)] = VersionTag(origin, version, via)
                e = open_(emb, _aad(gid, row_id, item_id, tag, first_field), f"row {row_id} {first_field}")
                s = b"" if second_field is None else open_(side, _aad(gid, row_id, item_id, tag, second_field), f"row {row_id} {second_field}")
                text = None
                if with_labels and label is not None:
                    text = open_(label, _aad(gid, row_id, item_id, _label_tag(origin), "label"), f"row {row_id} label").decode("utf-8")
            except (CorruptRecordError, GalleryError, TypeError) as exc:  # a damaged record or version tag
                corrupt.append((row_id, item_id, str(exc)))
                continue
            row_ids.append(row_id)
            item_ids.append(item_id)
            tags.append(tag)
            embeddings.append(e)
            side_infos.append(s)
            labels.append(text)
        return LoadedRows(
            row_ids=np.asarray(row_ids, dtype=np.int64), item_ids=item_ids, tags=tags,
            embeddings=_stack(embeddings), side_infos=_stack(side_infos), labels=labels, corrupt=corrupt,
        )

    # -- per-row extras (see EXTRA_FIELDS) ----------------------------------------------------

    def put_extras(self, field_name: str, rows: LoadedRows, values: np.ndarray) -> int:
        """Store one extra per row of ``rows`` (one transaction), each bound to the row's tag
        and kept only while the row still has that live tag; returns how many were stored."""
        with _transaction(self._db):
            live, _ = self._tables()
            written = 0
            for tag in set(rows.tags):
                picked = [i for i, t in enumerate(rows.tags) if t == tag]
                written += self._insert_extras(field_name, [int(rows.row_ids[i]) for i in picked],
                                               [rows.item_ids[i] for i in picked], tag, np.asarray(values)[picked], live=live)
        return written

    def _insert_extras(self, field_name: str, row_ids: Sequence[int], item_ids: Sequence[str], tag: VersionTag,
                       values: np.ndarray, *, live: str | None = None) -> int:
        """Inside a transaction: seal and store extras; with ``live``, only for rows whose live vectors have ``tag``."""
        block = np.ascontiguousarray(values, dtype="<f4").reshape(len(row_ids), -1)
        width = block.shape[1] * 4
        raw = block.tobytes()
        aads = [_aad(self.gallery_id, r, i, tag, EXTRA_FIELDS[field_name]) for r, i in zip(row_ids, item_ids, strict=True)]
        sealed = self._sealer.seal_many([raw[k * width:(k + 1) * width] for k in range(len(row_ids))], aads)
        guard = "" if live is None else f" AND EXISTS (SELECT 1 FROM {live} v WHERE v.row_id = ? AND v.version = ? AND v.via = ?)"
        params = [(r, field_name, tag.origin_version, tag.version, tag.via, blob, r) + (() if live is None else (r, tag.version, tag.via))
                  for r, blob in zip(row_ids, sealed, strict=True)]
        return self._db.executemany(f"INSERT OR REPLACE INTO row_extras SELECT ?, ?, ?, ?, ?, ? "
                                    f"WHERE EXISTS (SELECT 1 FROM items WHERE row_id = ?){guard}", params).rowcount

    def load_extras(self, field_name: str) -> LoadedRows:
        """The stored extras of ``field_name``, decrypted: ``embeddings`` holds the values and
        ``tags`` the tag each was bound to; extras that fail to open are in ``corrupt``."""
        with _read_snapshot(self._db):
            cursor = self._db.execute(
                "SELECT row_id, i.item_id, e.origin_version, e.version, e.via, e.sealed, NULL, NULL "
                "FROM row_extras e JOIN items i USING (row_id) WHERE e.field = ? ORDER BY row_id", (field_name,))
            return self._decrypt_rows(cursor, with_labels=False, fields=(EXTRA_FIELDS[field_name], None))

    def rows_missing_extra(self, field_name: str, version: int) -> LoadedRows:
        """The live rows in ``version``'s space without a ``field_name`` extra for their current tag, decrypted."""
        with _read_snapshot(self._db):
            live, _ = self._tables()
            cursor = self._db.execute(
                f"SELECT v.row_id, i.item_id, i.origin_version, v.version, v.via, v.embedding, v.side_info, NULL "
                f"FROM {live} v JOIN items i USING (row_id) LEFT JOIN row_extras e ON e.row_id = v.row_id AND e.field = ? "
                f"WHERE v.version = ? AND (e.row_id IS NULL OR e.origin_version != i.origin_version OR e.version != v.version "
                f"OR e.via != v.via) ORDER BY v.row_id", (field_name, version))
            return self._decrypt_rows(cursor, with_labels=False)

    def drop_extras(self, field_name: str, meta: dict[str, str | None] | None = None) -> int:
        """Delete every ``field_name`` extra and set ``meta``, in one transaction; returns the extras deleted."""
        with _transaction(self._db):
            dropped = self._db.execute("DELETE FROM row_extras WHERE field = ?", (field_name,)).rowcount
            self._set_meta(meta or {})
        return dropped

    def count_extras(self, field_name: str) -> int:
        return self._db.execute("SELECT COUNT(*) FROM row_extras WHERE field = ?", (field_name,)).fetchone()[0]

    def delete_rows(self, item_ids: Sequence[str]) -> int:
        """Remove items (rows, vectors and queued uploads) in one transaction, leaving a
        tombstone (a change to push) for each; returns the rows removed."""
        with _transaction(self._db):
            present = [(r, i) for i in item_ids for r, in self._db.execute("SELECT row_id FROM items WHERE item_id = ?", (i,))]
            for item_id in dict.fromkeys(i for _, i in present):
                self._remove_item(item_id, delete_original=True)
            self._log_changes([i for _, i in present], tombstone=True)
        return len(present)

    def _remove_item(self, item_id: str, *, tombstone: bool = True, delete_original: bool = False,
                     keep_queued: bool = False) -> bool:
        """Inside a transaction: delete the item's row, vectors, queued upload (unless
        ``keep_queued``) and unsealed change; with ``tombstone`` also its pending records, and
        remember the removal (with ``delete_original``, the vault original to delete once the
        removal is pushed). Returns whether the item had a row."""
        row = self._db.execute("SELECT row_id, vault_sha256 FROM items WHERE item_id = ?", (item_id,)).fetchone()
        if row is not None:
            for table in ("items", *VECTOR_TABLES, "row_extras"):
                self._db.execute(f"DELETE FROM {table} WHERE row_id = ?", row[:1])
            self._count_rows(-1)
        if not keep_queued:
            self._db.execute("DELETE FROM outbox WHERE item_id = ?", (item_id,))
        self._db.execute("DELETE FROM changes WHERE item_id = ? AND sealed IS NULL", (item_id,))
        if tombstone:
            self._db.execute("DELETE FROM pending_records WHERE item_id = ?", (item_id,))
            original = row[1] if row is not None and delete_original else None
            self._db.execute("INSERT OR IGNORE INTO tombstones VALUES (?, ?)", (item_id, original))
        return row is not None

    # -- repair (:mod:`.repair`) ------------------------------------------------------------

    def forget_rows(self, item_ids: Sequence[str], *, drop_queued: Sequence[str] = (),
                    drop_extras: Sequence[tuple[str, int]] = (), settings: dict[str, str | None] | None = None,
                    clear_table: str | None = None) -> int:
        """One repair transaction: forget damaged rows here only (no tombstone: the owner's other
        devices keep the items, and the replica can bring them back; a queued original stays
        queued), drop damaged queued originals and (field, row id) extras, empty ``clear_table``
        (the staged vectors of an upgrade given up), set ``settings``, and take the row count
        afresh. Returns the rows forgotten."""
        with _transaction(self._db):
            count = self._db.execute("SELECT COUNT(*) FROM items").fetchone()[0]
            self._set_meta({**(settings or {}), "row_count": str(count)})  # each forgotten row then counts down
            forgotten = sum(self._remove_item(item_id, tombstone=False, keep_queued=True) for item_id in item_ids)
            if clear_table is not None:  # an upgrade given up: its staged rows go, the live ones are untouched
                self._db.execute(f"DELETE FROM {VECTOR_TABLES[VECTOR_TABLES.index(clear_table)]}")
            self._db.executemany("DELETE FROM outbox WHERE item_id = ?", [(i,) for i in drop_queued])
            self._db.executemany("DELETE FROM row_extras WHERE field = ? AND row_id = ?", drop_extras)
        return forgotten

    def vector_table_rows(self) -> dict[str, int]:
        """Rows per vector table (to tell the live one when its setting is damaged)."""
        return {t: self._db.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in VECTOR_TABLES}

    def table_versions(self, table: str) -> list[int]:
        """The distinct versions of the rows of one vector table."""
        if table not in VECTOR_TABLES:
            raise GalleryError(f"no vector table {table!r}")
        return [v for v, in self._db.execute(f"SELECT DISTINCT version FROM {table} ORDER BY version")]

    def _log_changes(self, item_ids: Sequence[str] = (), *, tombstone: bool = False, select_sql: str | None = None) -> None:
        """Inside a transaction: the items changed locally (``item_ids``, or the rows of a
        ``SELECT item_id ...`` query); one unsealed change per item (the content is read when
        the change is sealed for pushing). Set-based: the upgrade's switch logs every row."""
        self._db.execute("CREATE TEMP TABLE IF NOT EXISTS changed_items (item_id TEXT NOT NULL)")
        self._db.execute("DELETE FROM temp.changed_items")
        if select_sql is None:
            self._db.executemany("INSERT INTO temp.changed_items VALUES (?)", [(i,) for i in item_ids])
        else:
            self._db.execute(f"INSERT INTO temp.changed_items {select_sql}")
        changed = "SELECT item_id FROM temp.changed_items"
        self._db.execute(f"DELETE FROM changes WHERE sealed IS NULL AND item_id IN ({changed})")
        self._db.execute("INSERT INTO changes (item_id, tombstone) SELECT item_id, ? FROM temp.changed_items ORDER BY rowid",
                         (int(tombstone),))
        if not tombstone:
            self._db.execute(f"UPDATE items SET record_sha256 = NULL WHERE item_id IN ({changed})")

    def _tombstoned(self, item_ids: Sequence[str]) -> list[str]:
        found = []
        for start in range(0, len(item_ids), _SQL_VARIABLES):
            chunk = list(item_ids[start:start + _SQL_VARIABLES])
            marks = ",".join("?" * len(chunk))
            found += [r[0] for r in self._db.execute(f"SELECT item_id FROM tombstones WHERE item_id IN ({marks})", chunk)]
        return found

    # -- upgrades --------------------------------------------------------------------------

    def rows_to_upgrade(self, target_version: int, after_row_id: int, limit: int) -> LoadedRows:
        """The next ``limit`` rows (by row id, after ``after_row_id``) not yet in ``target_version``'s
        space (live vectors elsewhere and nothing staged), decrypted."""
        with _read_snapshot(self._db):
            live, staged = self._tables()
            rows = self._db.execute(
                f"SELECT row_id, i.item_id, i.origin_version, v.version, v.via, v.embedding, v.side_info, NULL "
                f"FROM {live} v JOIN items i USING (row_id) WHERE {_not_yet_in(staged)} AND v.row_id > ? "
                f"ORDER BY v.row_id LIMIT ?",
                (target_version, after_row_id, limit),
            ).fetchall()
        return self._decrypt_rows(rows, with_labels=False)

    def row_versions(self, target_version: int) -> list[int]:
        """The version tags of the rows not yet in ``target_version``'s space (staged rows count as done)."""
        live, staged = self._tables()
        query = f"SELECT DISTINCT v.version FROM {live} v WHERE {_not_yet_in(staged)} ORDER BY v.version"
        return [row[0] for row in self._db.execute(query, (target_version,))]

    def remaining(self, target_version: int) -> int:
        live, staged = self._tables()
        query = f"SELECT COUNT(*) FROM {live} v WHERE {_not_yet_in(staged)}"
        return self._db.execute(query, (target_version,)).fetchone()[0]

    def not_native(self, version: int) -> int:
        """Live rows that are not ``version``'s own embeddings (adapted, or in another space)."""
        live, _ = self._tables()
        return self._db.execute(f"SELECT COUNT(*) FROM {live} WHERE NOT (version = ? AND via = 'native')", (version,)).fetchone()[0]

    def write_upgrades(self, batches: Sequence[UpgradedRows], *, staged: bool) -> None:
        """Write upgraded rows in one transaction, each guarded by the tag it was computed
        from (a row changed or staged since makes the whole transaction roll back).
        ``staged``: into the staged vector table (forward mode, switched later); else in place."""
        params = []
        for b in batches:
            embeddings, side_infos = self._seal_block(b.row_ids, b.item_ids, b.new_tag, b.embeddings, b.side_infos)
            new, old = b.new_tag, b.old_tag
            params += [(r, new.version, new.via, e, s, r, old.version, old.via)
                       for r, e, s in zip(b.row_ids, embeddings, side_infos, strict=True)]
        with _transaction(self._db):
            live, other = self._tables()
            if staged:
                sql = (f"INSERT INTO {other} (row_id, version, via, embedding, side_info) SELECT ?, ?, ?, ?, ? "
                       f"WHERE EXISTS (SELECT 1 FROM {live} WHERE row_id = ? AND version = ? AND via = ?)")
            else:
                sql = (f"UPDATE {live} SET row_id = ?, version = ?, via = ?, embedding = ?, side_info = ? "
                       f"WHERE row_id = ? AND version = ? AND via = ?")
            try:
                written = self._db.executemany(sql, params).rowcount
            except sqlite3.IntegrityError:
                raise GalleryError("a row of this batch is already upgraded (staged); run the upgrade again") from None
            if written != len(params):
                raise GalleryError(f"{len(params) - written} row(s) changed while being upgraded; run the upgrade again")
            if not staged:  # in place: live rows changed (staged ones change at the switch)
                self._log_changes([i for b in batches for i in b.item_ids])

    def switch_to(self, target_version: int, meta: dict[str, str | None], *, keep_previous: int | None = None) -> None:
        """Commit a forward-mode upgrade in one transaction: the staged vector table becomes
        live and the query version is set; refused while any row is not yet in the target space.
        Earlier previous-space embeddings are dropped; ``keep_previous``: the live rows in that
        version's space keep their embedding as ``previous_embedding`` (a transition begins)."""
        with _transaction(self._db):
            left = self.remaining(target_version)
            if left:
                raise GalleryError(f"{left} row(s) are not yet in v{target_version}'s space: finish the upgrade first")
            live, staged = self._tables()
            self._log_changes(select_sql=f"SELECT item_id FROM items JOIN {staged} USING (row_id) ORDER BY row_id")
            # rows already in the target space needed no transform: carried over unchanged
            self._db.execute(f"INSERT INTO {staged} SELECT * FROM {live} v WHERE NOT EXISTS "
                             f"(SELECT 1 FROM {staged} s WHERE s.row_id = v.row_id)")
            self._db.execute("DELETE FROM row_extras WHERE field = 'previous_embedding'")
            if keep_previous is not None:  # the sealed records move as they are: their AAD names their tag, not a table
                self._db.execute(f"INSERT INTO row_extras SELECT v.row_id, 'previous_embedding', i.origin_version, v.version, "
                                 f"v.via, v.embedding FROM {live} v JOIN items i USING (row_id) WHERE v.version = ?", (keep_previous,))
            self._db.execute(f"DELETE FROM {live}")
            self._set_meta({**meta, "query_version": str(target_version), "live_vectors": staged})

    # -- outbox ----------------------------------------------------------------------------

    def outbox(self) -> list[tuple[str, bytes]]:
        return list(self._db.execute("SELECT item_id, blob FROM outbox ORDER BY item_id"))

    def outbox_size(self) -> int:
        return self._db.execute("SELECT COUNT(*) FROM outbox").fetchone()[0]

    def mark_uploaded(self, item_id: str, sha256: str) -> None:
        with _transaction(self._db):
            self._db.execute("UPDATE items SET vault_sha256 = ? WHERE item_id = ?", (sha256, item_id))
            self._db.execute("DELETE FROM outbox WHERE item_id = ?", (item_id,))

    # -- replication -----------------------------------------------------------------------

    @property
    def replica_cursor(self) -> int:
        """The owner's last sequence number merged into this gallery."""
        return int(self.meta("replica_cursor", "0"))

    def replication_counts(self) -> dict[str, int]:
        """Changes not yet acknowledged by the server (unsealed + sealed) and pending records."""
        one = lambda sql: self._db.execute(sql).fetchone()[0]  # noqa: E731
        return {"cursor": self.replica_cursor, "unpushed": one("SELECT COUNT(*) FROM changes"),
                "pending": one("SELECT COUNT(*) FROM pending_records"), "tombstones": one("SELECT COUNT(*) FROM tombstones")}

    def unsealed_changes(self, limit: int) -> list[tuple[int, str, bool]]:
        """(change id, item id, tombstone) of changes to seal, oldest first; an item whose
        original still waits in the outbox is not pushed before the original is uploaded."""
        return [(c, i, bool(t)) for c, i, t in self._db.execute(
            "SELECT change_id, item_id, tombstone FROM changes c WHERE sealed IS NULL AND NOT EXISTS "
            "(SELECT 1 FROM outbox o WHERE o.item_id = c.item_id) ORDER BY change_id LIMIT ?", (limit,))]

    def load_items(self, item_ids: Sequence[str]) -> tuple[LoadedRows, dict[str, str | None]]:
        """The live rows of ``item_ids`` (decrypted, with labels) and each one's vault SHA-256."""
        found, shas = [], {}
        with _read_snapshot(self._db):
            live, _ = self._tables()
            for start in range(0, len(item_ids), _SQL_VARIABLES):
                chunk = list(item_ids[start:start + _SQL_VARIABLES])
                marks = ",".join("?" * len(chunk))
                found += self._db.execute(
                    f"SELECT row_id, i.item_id, i.origin_version, v.version, v.via, v.embedding, v.side_info, i.label "
                    f"FROM items i JOIN {live} v USING (row_id) WHERE i.item_id IN ({marks}) ORDER BY row_id", chunk).fetchall()
                shas.update(self._db.execute(f"SELECT item_id, vault_sha256 FROM items WHERE item_id IN ({marks})", chunk))
        return self._decrypt_rows(found, with_labels=True), shas

    def store_sealed(self, changes: Sequence[SealedChange]) -> int:
        """Keep the sealed records of changes (one transaction); a change whose row moved on
        or is gone since it was read is dropped (a newer change stands for it). Returns the
        changes stored."""
        rows = [c for c in changes if c.tag is not None]
        with _transaction(self._db):
            live, _ = self._tables()
            stored = self._db.executemany("UPDATE changes SET sealed = ? WHERE change_id = ? AND sealed IS NULL",
                                          [(c.sealed, c.change_id) for c in changes if c.tag is None]).rowcount
            stored += self._db.executemany(  # guarded: the row still has the tag it was sealed from
                f"UPDATE changes SET sealed = ?, version = ?, origin_version = ?, via = ? WHERE change_id = ? AND sealed IS NULL "
                f"AND EXISTS (SELECT 1 FROM items i JOIN {live} v USING (row_id) WHERE i.item_id = ? AND i.origin_version = ? "
                f"AND v.version = ? AND v.via = ?)",
                [(c.sealed, c.tag.version, c.tag.origin_version, c.tag.via, c.change_id, c.item_id, c.tag.origin_version,
                  c.tag.version, c.tag.via) for c in rows]).rowcount
            self._db.executemany("UPDATE items SET record_sha256 = ? WHERE item_id = ? AND EXISTS "
                                 "(SELECT 1 FROM changes WHERE change_id = ? AND sealed = ?)",
                                 [(c.sha256, c.item_id, c.change_id, c.sealed) for c in rows])
            # still unsealed: the row moved on or is gone since it was read; a newer change (or none) stands for it
            self._db.executemany("DELETE FROM changes WHERE change_id = ? AND sealed IS NULL", [(c.change_id,) for c in changes])
        return stored

    def sealed_changes(self, limit: int) -> list[tuple[int, str, int, int, str, bool, bytes]]:
        """(change id, item id, version, origin version, via, tombstone, sealed) to push, oldest first."""
        return [(c, i, v or 0, o or 0, via or "", bool(t), s) for c, i, v, o, via, t, s in self._db.execute(
            "SELECT change_id, item_id, version, origin_version, via, tombstone, sealed FROM changes "
            "WHERE sealed IS NOT NULL ORDER BY change_id LIMIT ?", (limit,))]

    def mark_pushed(self, change_ids: Sequence[int]) -> None:
        """The server acknowledged these changes: forget them (one transaction)."""
        with _transaction(self._db):
            self._db.executemany("DELETE FROM changes WHERE change_id = ?", [(c,) for c in change_ids])

    def originals_to_delete(self) -> list[tuple[str, str]]:
        """(item id, vault SHA-256) of items removed here whose tombstone the server has acknowledged."""
        return list(self._db.execute("SELECT item_id, vault_sha256 FROM tombstones t WHERE vault_sha256 IS NOT NULL "
                                     "AND NOT EXISTS (SELECT 1 FROM changes c WHERE c.item_id = t.item_id)"))

    def forget_original(self, item_id: str) -> None:
        """The removed item's original is gone from the vault."""
        with _transaction(self._db):
            self._db.execute("UPDATE tombstones SET vault_sha256 = NULL WHERE item_id = ?", (item_id,))

    def pending_records(self, up_to_version: int) -> list[tuple[int, str, int, int, str, bytes]]:
        """(sequence, item id, version, origin version, via, sealed) of kept records whose version is at most ``up_to_version``."""
        return list(self._db.execute("SELECT sequence, item_id, version, origin_version, via, sealed FROM pending_records "
                                     "WHERE version <= ? ORDER BY sequence", (up_to_version,)))

    def merge_replica(self, records: Sequence[Any], decide: Callable[[Any, ItemState], ReplicaWrite], *,
                      cursor: int | None = None, done_pending: Sequence[int] = ()) -> dict[str, int]:
        """Merge records in one transaction: ``decide(record, state)`` (state read inside the
        transaction, and updated as the batch goes) says what each does; then the cursor is
        set and the ``done_pending`` sequence numbers are dropped, so a crash leaves either
        all of it or none. Returns how many writes of each kind were made."""
        counts: dict[str, int] = {}
        with _transaction(self._db):
            if self.meta("upgrade") is not None:
                raise GalleryError("an upgrade is in progress: finish it before merging replicated records")
            live, _ = self._tables()
            states = self._item_states(live, [r.item_id for r in records])
            next_row_id = self._db.execute("SELECT COALESCE(MAX(row_id), 0) + 1 FROM items").fetchone()[0]
            for record in records:
                state = states[record.item_id]
                write = decide(record, state)
                if write.kind == "row":
                    self._apply(live, write, has_row=state.tag is not None, row_id=next_row_id)
                    next_row_id += 1
                    states[record.item_id] = ItemState(write.tag, write.record_sha256, False)
                else:
                    self._apply(live, write, has_row=state.tag is not None)
                    if write.kind == "tombstone":
                        states[record.item_id] = ItemState(None, None, True)
                counts[write.kind] = counts.get(write.kind, 0) + 1
            self._db.executemany("DELETE FROM pending_records WHERE sequence = ?", [(s,) for s in done_pending])
            if cursor is not None and cursor > self.replica_cursor:  # another process may have merged further
                self._set_meta({"replica_cursor": str(cursor)})
        return counts

    def _item_states(self, live: str, item_ids: Sequence[str]) -> dict[str, ItemState]:
        """Each item's state (inside the caller's transaction)."""
        unique = list(dict.fromkeys(item_ids))
        removed = set(self._tombstoned(unique))
        states = {i: ItemState(None, None, i in removed) for i in unique}
        for start in range(0, len(unique), _SQL_VARIABLES):
            chunk = unique[start:start + _SQL_VARIABLES]
            query = (f"SELECT i.item_id, i.origin_version, v.version, v.via, i.record_sha256 FROM items i "
                     f"JOIN {live} v USING (row_id) WHERE i.item_id IN ({','.join('?' * len(chunk))})")
            for item_id, origin, version, via, sha in self._db.execute(query, chunk):
                states[item_id] = ItemState(VersionTag(origin, version, via), sha, item_id in removed)
        return states

    def _apply(self, live: str, write: ReplicaWrite, *, has_row: bool, row_id: int = 0) -> None:
        if write.kind == "tombstone":
            self._remove_item(write.item_id)
        elif write.kind == "pending":
            tag = write.tag
            self._db.execute("INSERT OR IGNORE INTO pending_records VALUES (?, ?, ?, ?, ?, ?)",
                             (write.sequence, write.item_id, tag.version, tag.origin_version, tag.via, write.sealed))
        elif write.kind == "row":
            if has_row:  # an item without a row has no upload or unsealed change either
                self._remove_item(write.item_id, tombstone=False)
            tag = write.tag
            embedding, side_info = self._seal_vectors(row_id, write.item_id, tag, write.embedding, write.side_info)
            label = None if write.label is None else self._sealer.seal(
                write.label.encode("utf-8"), _aad(self.gallery_id, row_id, write.item_id, _label_tag(tag.origin_version), "label"))
            self._db.execute("INSERT INTO items VALUES (?, ?, ?, ?, ?, ?)",
                             (row_id, write.item_id, tag.origin_version, label, write.vault_sha256, write.record_sha256))
            self._db.execute(f"INSERT INTO {live} VALUES (?, ?, ?, ?, ?)", (row_id, tag.version, tag.via, embedding, side_info))
            self._count_rows(1)
            if write.record_sha256 is None:
                self._log_changes([write.item_id])
        elif write.kind != "ignore":
            raise GalleryError(f"unknown replica write {write.kind!r}")

    def reset_replication(self) -> None:
        """Start replicating afresh (the device joined another owner): cursor 0, no pending or
        sealed records, every row a change to push again."""
        with _transaction(self._db):
            self._db.execute("DELETE FROM pending_records")
            self._db.execute("DELETE FROM changes WHERE tombstone = 0")
            self._db.execute("UPDATE changes SET sealed = NULL, version = NULL, origin_version = NULL, via = NULL")
            self._log_changes([r[0] for r in self._db.execute("SELECT item_id FROM items")])
            self._set_meta({"replica_cursor": "0"})

    def vault_sha256(self, item_id: str) -> str | None:
        row = self._db.execute("SELECT vault_sha256 FROM items WHERE item_id = ?", (item_id,)).fetchone()
        if row is None:
            raise InputError(f"item {item_id!r} is not in the gallery")
        return row[0]


def _migration(db: sqlite3.Connection, from_schema: str) -> bool:
    """Inside a transaction: whether the gallery is still at ``from_schema`` (another process may
    have migrated it meanwhile)."""
    return db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0] == from_schema


def _add_replication(db: sqlite3.Connection, sealer: Sealer) -> None:
    """Schema 1 -> 2 in one transaction: the replication tables, and a change for every row."""
    with _transaction(db):
        if not _migration(db, "1"):
            return
        db.execute("ALTER TABLE items ADD COLUMN record_sha256 TEXT")
        for statement in filter(str.strip, _REPLICATION_SCHEMA.split(";")):
            db.execute(statement)
        db.execute("INSERT INTO changes (item_id, tombstone) SELECT item_id, 0 FROM items ORDER BY row_id")
        db.executemany("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", [("schema_version", "2"), ("replica_cursor", "0")])


def _add_row_extras(db: sqlite3.Connection, sealer: Sealer) -> None:
    """Schema 2 -> 3 in one transaction: the (empty) per-row extras table."""
    with _transaction(db):
        if not _migration(db, "2"):
            return
        db.execute(_EXTRAS_SCHEMA)
        db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('schema_version', '3')")


def _add_macs(db: sqlite3.Connection, sealer: Sealer) -> None:
    """Schema 3 -> 4 in one transaction: authenticated settings and row count (:func:`add_macs`)."""
    with _transaction(db):
        if not _migration(db, "3"):
            return
        db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
        add_macs(db, sealer)


def _check_essential(path: Path, db: sqlite3.Connection, sealer: Sealer, meta: dict[str, tuple]) -> None:
    """Authenticate the settings needed to open the gallery at all. When no setting at all
    authenticates, the key is not the gallery's; when only some fail, the file is damaged."""
    bad = [k for k in ESSENTIAL if k not in meta or not authentic(sealer, k, *meta[k])]
    if not bad:
        return
    if not any(authentic(sealer, k, v, m) for k, (v, m) in meta.items()):
        raise DeviceKeyError(f"{path} was not sealed with this device key: use the gallery's own key file (nothing was changed)")
    raise GallerySettings(db, sealer, path).error(bad)


def _tag_name(origin: int, version: int, via: str) -> str:
    try:
        return str(VersionTag(origin, version, via))
    except (GalleryError, TypeError):
        return f"damaged tag (origin {origin!r}, version {version!r}, via {via!r})"


def _stack(vectors: list[bytes]) -> np.ndarray:
    """An (n, d) float32 array; when rows of different spaces have different dims, an
    object array of 1-D vectors (use :func:`take_rows` to get a dense block of one space)."""
    if not vectors:
        return np.zeros((0, 0), dtype=np.float32)
    if len({len(v) for v in vectors}) == 1:
        return np.frombuffer(b"".join(vectors), dtype="<f4").reshape(len(vectors), -1).astype(np.float32, copy=False)
    ragged = np.empty(len(vectors), dtype=object)
    ragged[:] = [np.frombuffer(v, dtype="<f4") for v in vectors]
    return ragged


def _not_yet_in(staged: str) -> str:
    """SQL condition on a live vector row ``v``: not in the target version's space (its one
    parameter) and not staged there yet (``staged``: the staged vector table)."""
    return f"v.version != ? AND NOT EXISTS (SELECT 1 FROM {staged} s WHERE s.row_id = v.row_id)"


def take_rows(vectors: np.ndarray, rows: Sequence[int]) -> np.ndarray:
    """The dense (len(rows), d) float32 block of ``vectors`` (dense or ragged) at ``rows``."""
    picked = vectors[list(rows)]
    if picked.dtype == object:
        if len({len(v) for v in picked}) > 1:
            raise GalleryError("the selected rows have vectors of different dims (rows of different spaces)")
        return np.stack(list(picked)).astype(np.float32, copy=False) if len(picked) else np.zeros((0, 0), np.float32)
    return picked
