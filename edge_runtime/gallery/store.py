"""The encrypted on-device gallery: one SQLite file (WAL) of sealed blocks and per-row metadata.

Tables and migrations: :mod:`.schema` (schema 4 -> 5: :mod:`.block_migration`);
row values: :mod:`.rows`. Vectors live in blocks of up to 4,096 rows of one version
tag, each field sealed as one AES-GCM record (:mod:`.vectors`, :mod:`.blocks`),
so a whole gallery opens at block speed; labels and per-row extras are sealed per row
(:mod:`.sealing`). Two parts have their own class: :attr:`Gallery.extras`
(:mod:`.extras`) and :attr:`Gallery.replica_log` (outbox, changes to push, pulled
records: :mod:`.replica_log`); the upgrade reads and writes come from the base class
:class:`~.upgrades.GalleryUpgrades`.

Every write that changes a live row logs a change in the same transaction (adding, the
switch commit of an upgrade, in-place upgrades and backfills, removal as a tombstone); one
unsealed change per item is kept.

One of the two vector sets is live (``meta.live_vectors``: ``vectors_0`` or ``vectors_1``, each a
per-row table pointing into blocks of that set); a forward-mode upgrade writes new blocks into
the other set and the switch commit flips them in one transaction, so queries see complete old
vectors until then. The version tag (origin_version, version, via) says which space a row is in,
so backfilled and adapted rows sit side by side; a replicated row of a version not installed
yet waits in ``pending_blocks``.

A damaged block is reported as its rows (row id, item id, reason); the other blocks load.
Settings carry HMACs (:mod:`.settings`): a damaged one is named, never used;
``meta.row_count`` makes rows gone from the file a reported loss. SQLite errors on a damaged
file are :class:`GalleryDamagedError` (:mod:`..sqlite_file`).
"""

from __future__ import annotations

import base64
import json
import os
import sqlite3
from collections import Counter
from collections.abc import Iterable, Sequence
from itertools import repeat
from pathlib import Path
from typing import Any, cast, overload

import numpy as np

from fctkit.errors import CorruptRecordError, DeviceKeyError, GalleryDamagedError, GalleryError, InputError

from ..crypto import Sealer
from ..sqlite_file import GuardedConnection, connect, id_chunks, text_match
from ..sqlite_file import read_snapshot as _read_snapshot
from ..sqlite_file import transaction as _transaction
from .block_migration import migrate_to_blocks
from .blocks import check_item_ids
from .extras import RowExtras
from .repairs import GalleryRepairs
from .replica_log import InsertedRows, ReplicaLog
from .rows import LoadedRows, NewRow, VersionTag, tag_name
from .schema import (
    SCHEMA_VERSION,
    VECTOR_TABLES,
    check_essential,
    create_tables,
    migrate,
    migrate_replica_to_blocks,
    reseal_schema_record,
    vector_tables,
)
from .sealing import RowSealer
from .settings import GallerySettings, stored_name
from .upgrades import GalleryUpgrades
from .vectors import VectorBlocks, reconciled_with_items

_KEY_CHECK = b"fctkit-gallery-key-check"


class Gallery(GalleryUpgrades, GalleryRepairs):
    """An encrypted gallery file. Open with :meth:`create` (new) or :meth:`open` (existing).

    Readers and one writer may use the file at the same time (WAL): a query sees one
    consistent snapshot; each write is one transaction."""

    def __init__(self, path: Path, connection: GuardedConnection, sealer: Sealer, gallery_id: bytes) -> None:
        self.path = path
        self._db = connection
        self._sealer = sealer
        self.gallery_id = gallery_id
        self.settings = GallerySettings(connection, sealer, path)
        self._sealing = RowSealer(sealer, gallery_id)
        self._vectors = VectorBlocks(connection, sealer, gallery_id)
        self._extras = RowExtras(connection, self.settings, self._sealing, self._vectors, path)
        self._replica_log = ReplicaLog(self, connection, self._vectors, self._sealing.open_label)

    # -- opening ---------------------------------------------------------------------------

    @classmethod
    def create(cls, path: str | os.PathLike[str], key: bytes) -> Gallery:
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
            create_tables(db)
            GallerySettings(db, sealer, path).put(
                {
                    "schema_version": str(SCHEMA_VERSION),
                    "gallery_id": gallery_id.hex(),
                    "key_check": base64.b64encode(check).decode(),
                    "query_version": "0",
                    "live_vectors": VECTOR_TABLES[0],
                    "replica_cursor": "0",
                    "row_count": "0",
                }
            )
        return cls(path, db, sealer, gallery_id)

    @classmethod
    def open(cls, path: str | os.PathLike[str], key: bytes) -> Gallery:
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
    def _opened(cls, path: Path, db: GuardedConnection, sealer: Sealer) -> Gallery:
        try:
            columns = {row[1] for row in db.execute("PRAGMA table_info(meta)")}
            mac_column = "mac" if "mac" in columns else "NULL"
            meta = {k: (v, m) for k, v, m in db.execute(f"SELECT key, value, {mac_column} FROM meta")}
        except GalleryDamagedError as exc:
            raise GalleryDamagedError(
                f"{path} is not an fctkit gallery or is damaged beyond its records ({exc})"
            ) from None
        schema = check_essential(path, db, sealer, meta) if "mac" in columns else meta.get("schema_version", (None,))[0]
        if schema not in ("1", "2", "3", "4", "5", str(SCHEMA_VERSION)) or "gallery_id" not in meta:
            raise GalleryError(f"{path}: unsupported gallery schema {schema!r} (this fctkit reads {SCHEMA_VERSION})")
        try:
            gallery_id = bytes.fromhex(meta["gallery_id"][0])
            sealer.open(base64.b64decode(meta["key_check"][0]), b"key-check|" + gallery_id, "key check")
        except (CorruptRecordError, ValueError, KeyError):
            raise DeviceKeyError(
                f"{path} was not sealed with this device key: use the gallery's own key file (nothing was changed)"
            ) from None
        gallery = cls(path, db, sealer, gallery_id)  # its parts read nothing yet: the migrations come first
        if schema != str(SCHEMA_VERSION):  # as authenticated: a damaged record of a current gallery migrates nothing
            if "mac" in columns:
                reseal_schema_record(db, sealer, path, schema)
            migrate(db, sealer)
            migrate_to_blocks(db, gallery.settings, gallery._sealing, gallery._vectors)
            migrate_replica_to_blocks(db, gallery.settings)
        return gallery

    def reader(self) -> Gallery:
        """A second connection to the same gallery (for a thread that reads while this one writes)."""
        return Gallery(self.path, connect(self.path), self._sealer, self.gallery_id)

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Gallery:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def extras(self) -> RowExtras:
        """Values sealed beside the rows (:mod:`.extras`)."""
        return self._extras

    @property
    def replica_log(self) -> ReplicaLog:
        """The outbox, the log of changes to push and the pulled records (:mod:`.replica_log`)."""
        return self._replica_log

    # -- metadata --------------------------------------------------------------------------

    @overload
    def meta(self, key: str, default: str) -> str: ...
    @overload
    def meta(self, key: str, default: None = None) -> str | None: ...
    def meta(self, key: str, default: str | None = None) -> str | None:
        """An authenticated setting (:mod:`.settings`); a damaged one raises :class:`GalleryDamagedError`."""
        return self.settings.get(key, default)

    def set_meta(self, values: dict[str, str | None]) -> None:
        with _transaction(self._db):
            self._set_meta(values)

    def _set_meta(self, values: dict[str, str | None]) -> None:
        self.settings.put(values)

    def _count_rows(self, added: int) -> None:
        """Inside a write transaction: the authenticated row count moves with every row added or removed."""
        if added:
            self._set_meta({"row_count": str(int(cast(str, self.meta("row_count"))) + added)})  # a REQUIRED setting

    def recount_rows(self) -> int:
        """Take the row count afresh from the file (repair, after damage was dealt with)."""
        with _transaction(self._db):
            count: int = self._db.execute("SELECT COUNT(*) FROM items").fetchone()[0]
            self._set_meta({"row_count": str(count)})
        return count

    @property
    def query_version(self) -> int:
        """The installed version whose query model answers queries (0: none yet)."""
        return int(self.meta("query_version", "0"))

    @property
    def upgrade_state(self) -> dict[str, Any] | None:  # the upgrade in progress (target, mode, hops) or None
        text = self.meta("upgrade")
        return json.loads(text) if text else None

    def change_marker(self) -> tuple[int, int]:  # changes whenever any connection commits a write (search cache key)
        return self._db.execute("PRAGMA data_version").fetchone()[0], self._db.total_changes

    def _tables(self) -> tuple[str, str]:
        return vector_tables(self.settings, self.path)

    def __len__(self) -> int:
        return cast(int, self._db.execute("SELECT COUNT(*) FROM items").fetchone()[0])

    def tag_counts(self) -> dict[str, int]:
        """How many rows are in each space (``str(VersionTag)``), staged rows counted at their next tag.
        Tags of one space (a version's native rows, whatever their origin) add up under its name."""
        with _read_snapshot(self._db):
            live, staged = self._tables()
            query = (
                f"SELECT i.origin_version, COALESCE(s.version, v.version), COALESCE(s.via, v.via), COUNT(*) "
                f"FROM items i JOIN {live} v USING (row_id) LEFT JOIN {staged} s USING (row_id) GROUP BY 1, 2, 3"
            )
            rows = self._db.execute(query).fetchall()
        counts: Counter[str] = Counter()
        for o, v, via, n in rows:
            counts[tag_name(o, v, via)] += n
        return dict(counts)

    # -- rows ------------------------------------------------------------------------------

    def add_rows(
        self,
        rows: Sequence[NewRow],
        tag: VersionTag,
        outbox: Sequence[tuple[str, bytes]] = (),
        *,
        query_version: int | None = None,
        previous: tuple[VersionTag, np.ndarray] | None = None,
        in_vault: dict[str, str] | None = None,
    ) -> list[int]:
        """Insert rows (and their queued vault uploads) in one transaction; returns the row ids.
        An item id already in the gallery is an error, and so is a ``query_version`` that is no
        longer the gallery's (another process switched it meanwhile): nothing is written.
        ``previous``: the rows' embeddings in the previous version's space (a transition);
        ``in_vault``: item id -> SHA-256 of an original already in the vault (restored rows)."""
        check_item_ids(row.item_id for row in rows)
        with _transaction(self._db):
            if query_version is not None and self.query_version != query_version:
                raise GalleryError(
                    f"the gallery switched to v{self.query_version} while these rows were embedded with v{query_version}: add them again"
                )
            live, _ = self._tables()
            first = self._next_row_id()
            ids = list(range(first, first + len(rows)))
            item_ids = [row.item_id for row in rows]
            labels = self._sealing.seal_labels(
                ids, item_ids, [tag.origin_version] * len(ids), [row.label for row in rows]
            )
            try:
                self._db.executemany(
                    "INSERT INTO items (row_id, item_id, origin_version, label) VALUES (?, ?, ?, ?)",
                    zip(ids, item_ids, repeat(tag.origin_version), labels),
                )
            except sqlite3.IntegrityError:
                raise InputError(
                    "an item id is already in the gallery: item ids are unique (nothing was added)"
                ) from None
            removed = self._tombstoned([row.item_id for row in rows])
            if removed:
                raise InputError(
                    f"item id {removed[0]!r} was removed before: removed ids are never used again "
                    "(the removal replicates to the owner's devices); choose new ids (nothing was added)"
                )
            self._write_vectors(live, ids, item_ids, [r.embedding for r in rows], [r.side_info for r in rows], tag)
            self._db.executemany("INSERT INTO outbox VALUES (?, ?)", outbox)
            self._db.executemany(
                "UPDATE items SET vault_sha256 = ? WHERE item_id = ?", [(h, i) for i, h in (in_vault or {}).items()]
            )
            self._count_rows(len(rows))
            self._log_changes(item_ids)
            if previous is not None:
                self._extras.insert("previous_embedding", ids, item_ids, previous[0], previous[1])
        return ids

    def _next_row_id(self) -> int:
        """The first free row id, also above a damaged pointer left without its row (a collision would stop every add)."""
        return cast(
            int,
            self._db.execute(
                "SELECT MAX(COALESCE((SELECT MAX(row_id) FROM items), 0), COALESCE((SELECT MAX(row_id) FROM "
                "vectors_0), 0), COALESCE((SELECT MAX(row_id) FROM vectors_1), 0)) + 1"
            ).fetchone()[0],
        )

    def _write_vectors(
        self,
        vector_set: str,
        row_ids: Sequence[int],
        item_ids: Sequence[str],
        embeddings: Any,
        side_infos: Any,
        tag: VersionTag,
    ) -> None:
        """Inside a transaction: seal the rows' vectors (one per row, or an (n, d) array each) as blocks of
        ``vector_set`` and point the rows to them."""
        block_of = self._vectors.write(vector_set, tag, row_ids, item_ids, embeddings, side_infos)
        self._db.executemany(
            f"INSERT INTO {vector_set} VALUES (?, ?, ?, ?)",
            [(r, tag.version, tag.via, int(b)) for r, b in zip(row_ids, block_of, strict=True)],
        )

    def _insert_rows(self, live: str, inserted: InsertedRows) -> None:
        """Inside a transaction: replicated rows of one tag under free row ids (:mod:`.replica_log`),
        their vectors sealed in blocks."""
        rows, tag = inserted.rows, inserted.tag
        check_item_ids(rows.item_ids)
        ids = list(range(inserted.first_row_id, inserted.first_row_id + len(rows)))
        labels = self._sealing.seal_labels(ids, rows.item_ids, [tag.origin_version] * len(ids), rows.labels)
        self._db.executemany(
            "INSERT INTO items VALUES (?, ?, ?, ?, ?, ?)",
            zip(
                ids,
                rows.item_ids,
                repeat(tag.origin_version),
                labels,
                rows.vault_sha256s,
                repeat(inserted.record_sha256),
            ),
        )
        self._write_vectors(live, ids, rows.item_ids, rows.embeddings, rows.side_infos, tag)
        self._count_rows(len(ids))

    def load(self, *, with_labels: bool = True, with_side_info: bool = True) -> LoadedRows:
        """Decrypt every row in one consistent snapshot, block by block (no per-row query). Rows
        that fail to open are listed in ``corrupt`` (row id, item id, reason); the others load.
        ``with_side_info=False``: side-info left sealed (a search needs none). ``with_labels``
        also reads the per-row tables: labels opened, disagreements with the blocks corrupt."""
        with _read_snapshot(self._db):
            live, _ = self._tables()
            expected = int(cast(str, self.meta("row_count")))  # a REQUIRED setting: never None
            loaded = self._vectors.load(live, side_info=with_side_info)
            if with_labels:
                items = self._db.execute(
                    f"SELECT row_id, i.item_id, i.origin_version, i.label, v.version, v.via "
                    f"FROM items i LEFT JOIN {live} v USING (row_id)"
                )
                loaded = reconciled_with_items(loaded, items, self._sealing.open_label)
        loaded.missing = max(0, expected - len(loaded) - len(loaded.corrupt))
        return loaded

    def labels(
        self, row_ids: Iterable[int], damaged: list[tuple[int, str, str]] | None = None
    ) -> dict[int, str | None]:
        """The labels of these rows (a row whose label fails to open: None, and (row id, item
        id, reason) appended to ``damaged``)."""
        found: dict[int, str | None] = {}
        for chunk, marks in id_chunks([int(r) for r in row_ids]):
            for row_id, item_id, origin, label in self._db.execute(
                f"SELECT row_id, item_id, origin_version, label FROM items WHERE row_id IN ({marks})", chunk
            ):
                try:
                    found[row_id] = None if label is None else self._sealing.open_label(row_id, item_id, origin, label)
                except CorruptRecordError as exc:
                    found[row_id] = None
                    if damaged is not None:
                        damaged.append((row_id, stored_name(item_id), str(exc)))
        return found

    def delete_rows(self, item_ids: Sequence[str]) -> int:
        """Remove items (rows, vectors and queued uploads) in one transaction, leaving a
        tombstone (a change to push) for each; returns the rows removed."""
        with _transaction(self._db):
            present = [
                (r, i)
                for i in item_ids
                for (r,) in self._db.execute("SELECT row_id FROM items WHERE item_id = ?", (i,))
            ]
            for table in VECTOR_TABLES:  # all at once: a block emptied by this call is dropped, not compacted first
                self._vectors.retire(table, [r for r, _ in present])
            for item_id in dict.fromkeys(i for _, i in present):
                self._remove_item(item_id, delete_original=True, retired=True)
            self._log_changes([i for _, i in present], tombstone=True)
        return len(present)

    def _remove_item(
        self,
        item_id: str,
        *,
        tombstone: bool = True,
        delete_original: bool = False,
        keep_queued: bool = False,
        retired: bool = False,
    ) -> bool:
        """Inside a transaction: delete the item's row, vectors, queued upload (unless
        ``keep_queued``) and unsealed change; with ``tombstone`` remember the removal (with ``delete_original``, the vault original to delete once the
        removal is pushed; ``retired``: the caller retired the row's vectors already). Returns
        whether the item had a row."""
        row = self._db.execute("SELECT row_id, vault_sha256 FROM items WHERE item_id = ?", (item_id,)).fetchone()
        if row is not None:
            for table in VECTOR_TABLES if not retired else ():
                self._vectors.retire(table, row[:1])
            for table in ("items", *VECTOR_TABLES, "row_extras"):
                self._db.execute(f"DELETE FROM {table} WHERE row_id = ?", row[:1])
            self._count_rows(-1)
        if not keep_queued:
            self._db.execute("DELETE FROM outbox WHERE item_id = ?", (item_id,))
        self._db.execute("DELETE FROM changes WHERE item_id = ?", (item_id,))
        if tombstone:  # pending records of the item stay: merging them later finds the tombstone
            original = row[1] if row is not None and delete_original else None
            self._db.execute("INSERT OR IGNORE INTO tombstones VALUES (?, ?)", (item_id, original))
        return row is not None

    # -- repair (:mod:`..repair`) ------------------------------------------------------------

    def forget_rows(
        self,
        rows: Sequence[tuple[int, str]],
        *,
        drop_queued: Sequence[str] = (),
        drop_extras: Sequence[tuple[str, int]] = (),
        settings: dict[str, str | None] | None = None,
        clear_table: str | None = None,
    ) -> int:
        """One repair transaction: forget damaged rows (row id, item id) here only (no tombstone: the owner's other
        devices keep the items, and the replica can bring them back; a queued original stays
        queued), drop damaged queued originals and (field, row id) extras, empty ``clear_table``
        (the staged vectors of an upgrade given up), set ``settings``, and take the row count
        afresh. Returns the rows forgotten."""
        with _transaction(self._db):
            count = self._db.execute("SELECT COUNT(*) FROM items").fetchone()[0]
            self._set_meta({**(settings or {}), "row_count": str(count)})  # each forgotten row then counts down
            forgotten = sum(self._forget_row(row_id, item_id) for row_id, item_id in rows)
            if clear_table is not None:  # an upgrade given up: its staged rows go, the live ones are untouched
                self._vectors.drop_set(clear_table)
                self._db.execute(f"DELETE FROM {VECTOR_TABLES[VECTOR_TABLES.index(clear_table)]}")
            self._db.executemany(
                "DELETE FROM outbox WHERE CAST(item_id AS BLOB) = ?",  # a damaged id: as the bytes read
                [(i.encode("utf-8", "surrogateescape"),) for i in drop_queued],
            )
            self._db.executemany("DELETE FROM row_extras WHERE field = ? AND row_id = ?", drop_extras)
            self._repair_file()
            for table in VECTOR_TABLES:  # e.g. a block whose dead list failed authentication, all its rows forgotten
                self._vectors.sweep(table)
        return forgotten

    def _repair_file(self) -> None:
        """Inside the repair transaction: rebuild damaged indexes, set the block id counter back,
        point rows to the blocks that hold them, unstage damaged staged rows (the upgrade stages
        them again from their live rows)."""
        if any("index" in problem for problem in self.sqlite_problems()):
            self._db.execute("REINDEX")
        self._vectors.restore_sequence()
        for table in VECTOR_TABLES:
            misplaced = self._vectors.misplaced(table)
            known = self._known_rows([r for r, _, _ in misplaced])
            self._vectors.repoint(
                table, [(r, b, tag) for r, b, tag in misplaced if b is not None and tag is not None and r in known]
            )
            self._vectors.retire_held(table, [(r, b) for r, b, _ in misplaced if b is not None and r not in known])
            for chunk, marks in id_chunks(
                [r for r, b, _ in misplaced if b is None and r not in known]
            ):  # pointers to nothing
                self._db.execute(f"DELETE FROM {table} WHERE row_id IN ({marks})", chunk)
        self._unstage_damaged()

    def _known_rows(self, row_ids: Sequence[int]) -> set[int]:
        """Those of ``row_ids`` that have a per-row entry."""
        found: set[int] = set()
        for chunk, marks in id_chunks(list(row_ids)):
            found.update(r for (r,) in self._db.execute(f"SELECT row_id FROM items WHERE row_id IN ({marks})", chunk))
        return found

    def damaged_pointers(self) -> list[int]:
        """Rows whose pointer to their vectors is damaged where the vectors are intact (repair points
        them back; until then an upgrade, which reads rows by their pointers, refuses to start)."""
        found: list[int] = []
        for table in VECTOR_TABLES:
            misplaced = self._vectors.misplaced(table)
            known = self._known_rows([r for r, _, _ in misplaced])
            found += [r for r, b, _ in misplaced if (b is not None) == (r in known)]
        return sorted(set(found))

    def sqlite_problems(self) -> list[str]:
        """What SQLite's own integrity check finds in the file (b-trees, indexes); empty: nothing."""
        try:
            found = [row[0] for row in self._db.execute("PRAGMA integrity_check(20)")]
        except GalleryDamagedError as exc:
            return [f"SQLite cannot check the file: {exc.__context__ or exc}"]
        return [] if found == ["ok"] else [str(p) for p in found]

    def file_damage(self) -> dict[str, Any]:
        """Damage beyond the rows and SQLite's integrity check (:func:`~..repair.damage_report`): id
        counters, row pointers naming the wrong block (live and staged), staged rows that
        fail to open."""
        return {
            "damaged_id_counters": self._vectors.damaged_sequences(),
            "damaged_row_pointers": self.damaged_pointers(),
            "damaged_staged_rows": [list(r) for r in self.staged_damage()],
        }

    def _forget_row(self, row_id: int, item_id: str) -> bool:
        """Inside the repair transaction: forget one damaged row, also when its per-row entry is
        gone or names another item (its vectors then only sit in a block): no tombstone."""
        owner = self._db.execute("SELECT item_id FROM items WHERE row_id = ?", (row_id,)).fetchone()
        for table in VECTOR_TABLES:  # also vectors left in a block by a per-row entry that was gone or wrong
            self._vectors.retire(table, [row_id])
        for table in ("items", *VECTOR_TABLES, "row_extras"):  # by row id: its item id may be damaged text
            self._db.execute(f"DELETE FROM {table} WHERE row_id = ?", (row_id,))
        if owner is not None:
            where, param = text_match("item_id", stored_name(owner[0]))
            self._db.execute(f"DELETE FROM changes WHERE {where}", (param,))
            self._count_rows(-1)
        return True

    def vector_table_rows(self) -> dict[str, int]:
        """Rows per vector table (to tell the live one when its setting is damaged)."""
        return {t: self._db.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in VECTOR_TABLES}

    def table_versions(self, table: str) -> list[int]:
        """The distinct versions of the rows of one vector table."""
        if table not in VECTOR_TABLES:
            raise GalleryError(f"no vector table {table!r}")
        return [v for (v,) in self._db.execute(f"SELECT DISTINCT version FROM {table} ORDER BY version")]

    def _log_changes(
        self, item_ids: Sequence[str] = (), *, tombstone: bool = False, select_sql: str | None = None
    ) -> None:
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
        self._db.execute(f"DELETE FROM changes WHERE item_id IN ({changed})")
        self._db.execute(
            "INSERT INTO changes (item_id, tombstone) SELECT item_id, ? FROM temp.changed_items ORDER BY rowid",
            (int(tombstone),),
        )
        if not tombstone:
            self._db.execute(f"UPDATE items SET record_sha256 = NULL WHERE item_id IN ({changed})")

    def _tombstoned(self, item_ids: Sequence[str]) -> list[str]:
        found = []
        for chunk, marks in id_chunks(item_ids):
            found += [
                r[0] for r in self._db.execute(f"SELECT item_id FROM tombstones WHERE item_id IN ({marks})", chunk)
            ]
        return found
