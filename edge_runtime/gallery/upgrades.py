"""The gallery's upgrade reads and writes (:class:`GalleryUpgrades`, a base of
:class:`~fctkit.edge_runtime.gallery.Gallery`): the rows not yet in a version's space, batches
written guarded by the tag they were computed from (staged, or in place), and the switch commit
that makes the staged vector set live."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Sequence

import numpy as np

from fctkit.errors import CorruptRecordError, GalleryError

from ..sqlite_file import id_chunks, read_snapshot, transaction
from .extras import ROLLBACK_FIELDS, RowExtras
from .replica_log import ReplicaLog
from .rows import LoadedRows, UpgradedRows, VersionTag, rows_by_tag, take_rows
from .sealing import RowSealer
from .vectors import VectorBlocks


class GalleryUpgrades:
    """The upgrade part of a gallery; :class:`~fctkit.edge_runtime.gallery.Gallery` provides the
    connection, the blocks, the extras and the helpers declared here."""

    _db: sqlite3.Connection
    _vectors: VectorBlocks
    _extras: RowExtras
    _sealing: RowSealer
    _replica_log: ReplicaLog
    _tables: Callable[[], tuple[str, str]]  # (live, staged) vector tables
    _log_changes: Callable[..., None]  # the change log: item ids, or select_sql=...
    _set_meta: Callable[[dict[str, str | None]], None]  # the authenticated settings

    # -- upgrades --------------------------------------------------------------------------

    def rows_to_upgrade(self, target_version: int, after_row_id: int, limit: int) -> LoadedRows:
        """The next ``limit`` rows (by row id, after ``after_row_id``) not yet in ``target_version``'s
        space (live vectors elsewhere and nothing staged), decrypted."""
        with read_snapshot(self._db):
            live, staged = self._tables()
            rows = self._db.execute(
                f"SELECT row_id, i.item_id, i.origin_version, v.version, v.via, v.block_id, NULL "
                f"FROM {live} v JOIN items i USING (row_id) WHERE {_not_yet_in(staged)} AND v.row_id > ? "
                f"ORDER BY v.row_id LIMIT ?",
                (target_version, after_row_id, limit),
            ).fetchall()
            return self._vectors.open_pointers(rows)

    def adapted_rows(self, version: int, *, in_vault: bool, limit: int = -1) -> list[tuple[int, str]]:
        """(row id, item id) of the first ``limit`` (-1: all) live rows adapted into ``version``'s space
        (via forward), by row id; ``in_vault``: only those whose original is in the vault. Nothing is decrypted."""
        live, _ = self._tables()
        vault = "AND i.vault_sha256 IS NOT NULL " if in_vault else ""
        return self._db.execute(
            f"SELECT v.row_id, i.item_id FROM {live} v JOIN items i USING (row_id) WHERE v.version = ? "
            f"AND v.via = 'forward' {vault}ORDER BY v.row_id LIMIT ?",
            (version, limit),
        ).fetchall()

    def space_rows(
        self, version: int, after_row_id: int, limit: int, *, only: Sequence[int] | None = None
    ) -> LoadedRows:
        """The next ``limit`` live rows (by row id, after ``after_row_id``) in ``version``'s space,
        decrypted (a page of a streamed read); ``only``: among these row ids."""
        among = "" if only is None else "AND v.row_id IN (SELECT value FROM json_each(?)) "
        params = (version, after_row_id, *(() if only is None else (json.dumps([int(r) for r in only]),)), limit)
        with read_snapshot(self._db):
            live, _ = self._tables()
            rows = self._db.execute(
                f"SELECT row_id, i.item_id, i.origin_version, v.version, v.via, v.block_id, NULL FROM {live} v "
                f"JOIN items i USING (row_id) WHERE v.version = ? AND v.row_id > ? {among}ORDER BY v.row_id LIMIT ?",
                params,
            ).fetchall()
            return self._vectors.open_pointers(rows)

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
        return self._db.execute(
            f"SELECT COUNT(*) FROM {live} WHERE NOT (version = ? AND via = 'native')", (version,)
        ).fetchone()[0]

    def write_upgrades(self, batches: Sequence[UpgradedRows], *, staged: bool, logged: bool = True) -> None:
        """Write upgraded rows in one transaction, each guarded by the tag it was computed
        from (a row changed or staged since makes the whole transaction roll back).
        ``staged``: into the staged vector table (forward mode, switched later); else in place,
        the change logged for replication unless ``logged`` is False (repair's lost side-info)."""
        with transaction(self._db):
            self._write_rows(batches, staged=staged, logged=logged)

    def revert_rows(self, batches: Sequence[UpgradedRows], meta: dict[str, str | None]) -> None:
        """A revert in one transaction (:mod:`..revert`): the rows written back in place (each guarded
        by its live tag, logged for replication), the rollback vectors and a transition's previous
        embeddings dropped, ``meta`` set."""
        with transaction(self._db):
            self._write_rows(batches, staged=False, logged=True)
            self._db.execute(f"DELETE FROM row_extras WHERE field IN ('previous_embedding', {ROLLBACK_FIELDS[1:-1]})")
            self._set_meta(meta)

    def give_up_staged(self, meta: dict[str, str | None]) -> int:
        """Give up a forward-mode upgrade before its switch, in one transaction: its staged vectors
        dropped (the live rows, which queries use, untouched) and ``meta`` set (its record cleared).
        Returns the staged rows dropped."""
        with transaction(self._db):
            _, staged = self._tables()
            self._vectors.drop_set(staged)
            dropped: int = self._db.execute(f"DELETE FROM {staged}").rowcount
            self._set_meta(meta)
        return dropped

    def drop_rollback(self, meta: dict[str, str | None]) -> int:
        """Delete the rollback vectors and set ``meta`` (one transaction); returns the extras deleted."""
        with transaction(self._db):
            dropped = self._db.execute(f"DELETE FROM row_extras WHERE field IN {ROLLBACK_FIELDS}").rowcount
            self._set_meta(meta)
        return dropped

    def heal_origins(self) -> int:
        """One transaction: live rows whose origin version is above their version (so tagged by reverts
        that kept the origin of rows added on the withdrawn version; the server refuses their records)
        take their version as origin, their vectors sealed again under that tag and the change logged;
        sealed records of such tags not yet pushed are dropped and their items logged again. Rows that
        do not open stay (check and repair report them), and so do rows an upgrade under way staged
        (sealed with their origin: the switch carries them to a version at least as high). Returns
        the rows healed."""
        with transaction(self._db):
            live, staged = self._tables()
            rows = self._vectors.open_pointers(
                self._db.execute(
                    f"SELECT row_id, i.item_id, i.origin_version, v.version, v.via, v.block_id, NULL FROM {live} v "
                    f"JOIN items i USING (row_id) WHERE i.origin_version > v.version "
                    f"AND NOT EXISTS (SELECT 1 FROM {staged} s WHERE s.row_id = v.row_id) ORDER BY row_id"
                ).fetchall()
            )
            healed = [
                UpgradedRows(
                    rows.row_ids[picked].tolist(),
                    [rows.item_ids[i] for i in picked],
                    tag,
                    VersionTag(tag.version, tag.version, tag.via),
                    take_rows(rows.embeddings, picked),
                    take_rows(rows.side_infos, picked),
                )
                for tag, picked in rows_by_tag(rows.tags).items()
            ]
            if healed:
                self._write_rows(healed, staged=False, logged=True)
            if logged_again := self._replica_log._drop_misplaced_origins():
                self._log_changes(logged_again)
        return len(rows)

    def live_rows(self) -> dict[int, tuple[str, VersionTag]]:
        """Every live row's item id and current tag, by row id (nothing decrypted)."""
        live, _ = self._tables()
        return {
            r: (item, VersionTag(o, v, via))
            for r, item, o, v, via in self._db.execute(
                f"SELECT v.row_id, i.item_id, i.origin_version, v.version, v.via FROM {live} v JOIN items i USING (row_id)"
            )
        }

    def _write_rows(self, batches: Sequence[UpgradedRows], *, staged: bool, logged: bool) -> None:
        """Inside a transaction: :meth:`write_upgrades`' writes."""
        live, other = self._tables()
        if staged:  # set-based, one statement per new block: the rows' ids go in as one JSON array
            sql = (
                f"INSERT INTO {other} (row_id, version, via, block_id) SELECT row_id, ?, ?, ? FROM {live} "
                f"WHERE row_id IN (SELECT value FROM json_each(?)) AND version = ? AND via = ?"
            )
        else:  # the rows leave their old blocks (retired there) for the new ones
            self._vectors.retire(live, [r for b in batches for r in b.row_ids])
            sql = (
                f"UPDATE {live} SET version = ?, via = ?, block_id = ? "
                f"WHERE row_id IN (SELECT value FROM json_each(?)) AND version = ? AND via = ?"
            )
        written = 0
        try:
            for b in batches:
                block_of = self._vectors.write(
                    other if staged else live, b.new_tag, b.row_ids, b.item_ids, b.embeddings, b.side_infos
                )
                for block_id in np.unique(block_of):
                    rows = json.dumps(np.asarray(b.row_ids, dtype=np.int64)[block_of == block_id].tolist())
                    params = (b.new_tag.version, b.new_tag.via, int(block_id), rows, b.old_tag.version, b.old_tag.via)
                    written += self._db.execute(sql, params).rowcount
        except sqlite3.IntegrityError:
            raise GalleryError("a row of this batch is already upgraded (staged); run the upgrade again") from None
        expected = sum(len(b.row_ids) for b in batches)
        if written != expected:
            raise GalleryError(f"{expected - written} row(s) changed while being upgraded; run the upgrade again")
        if not staged:
            self._move_origins([b for b in batches if b.new_tag.origin_version != b.old_tag.origin_version])
        if not staged and logged:  # in place: live rows changed (staged ones change at the switch)
            self._log_changes([i for b in batches for i in b.item_ids])

    def _move_origins(self, batches: Sequence[UpgradedRows]) -> None:
        """Inside a transaction: the rows of ``batches`` take their new tag's origin version in their
        per-row entry (each guarded by the old one), their labels sealed again for it; a label that
        does not open stays as it was (damage that check and repair report, as before)."""
        for b in batches:
            old, new = b.old_tag.origin_version, b.new_tag.origin_version
            found = []
            for chunk, marks in id_chunks([int(r) for r in b.row_ids]):
                found += self._db.execute(
                    f"SELECT row_id, item_id, label FROM items WHERE origin_version = ? AND row_id IN ({marks})",
                    (old, *chunk),
                ).fetchall()
            if len(found) != len(b.row_ids):
                raise GalleryError(f"{len(b.row_ids) - len(found)} row(s) changed while being moved; run it again")
            labels = [self._reopened_label(row_id, item_id, old, label) for row_id, item_id, label in found]
            resealed = self._sealing.seal_labels(
                [r for r, _, _ in found], [i for _, i, _ in found], [new] * len(found), labels
            )
            self._db.executemany(
                "UPDATE items SET origin_version = ?, label = ? WHERE row_id = ?",
                [
                    (new, sealed if text is not None else label, row_id)
                    for (row_id, _, label), text, sealed in zip(found, labels, resealed, strict=True)
                ],
            )

    def _reopened_label(self, row_id: int, item_id: str, origin: int, sealed: bytes | None) -> str | None:
        """A row's label, or None when it has none or it does not open."""
        try:
            return None if sealed is None else self._sealing.open_label(row_id, item_id, origin, sealed)
        except CorruptRecordError:
            return None

    def staged_damage(self) -> list[tuple[int, str, str]]:
        """(row id, item id, reason) of the staged rows (an upgrade's, not yet switched) whose
        vectors fail to open or are gone; the resume stages them again from their live rows."""
        with read_snapshot(self._db):
            return self._staged_damage()

    def _staged_damage(self) -> list[tuple[int, str, str]]:
        _, staged = self._tables()
        unheld = [
            (r, "?", f"row {r}: its staged vectors are missing")
            for r, b, _ in self._vectors.misplaced(staged)
            if b is None
        ]
        return sorted(self._vectors.load(staged).corrupt + unheld)

    def unstage_damaged(self) -> int:
        """Unstage the rows of :meth:`staged_damage` (one transaction): an upgrade's resume then
        stages them again from their live rows instead of switching damaged vectors live."""
        with transaction(self._db):
            return self._unstage_damaged()

    def _unstage_damaged(self) -> int:
        _, staged = self._tables()
        rows = [r for r, _, _ in self._staged_damage()]
        self._vectors.retire(staged, rows)
        for chunk, marks in id_chunks(rows):
            self._db.execute(f"DELETE FROM {staged} WHERE row_id IN ({marks})", chunk)
        return len(rows)

    def switch_to(
        self,
        target_version: int,
        meta: dict[str, str | None],
        *,
        keep_previous: int | None = None,
        keep_rollback: bool = False,
    ) -> None:
        """Commit a forward-mode upgrade in one transaction: the staged vector table becomes
        live and the query version is set; refused while any row is not yet in the target space.
        Earlier previous-space embeddings are dropped; ``keep_previous``: the live rows in that
        version's space keep their embedding as ``previous_embedding`` (a transition begins);
        ``keep_rollback``: every live row keeps its embedding and side-info as it was, sealed under
        its tag (``rollback_embedding``, ``rollback_side_info``: a rollback window begins, :mod:`..revert`)."""
        with transaction(self._db):
            left = self.remaining(target_version)
            if left:
                raise GalleryError(f"{left} row(s) are not yet in v{target_version}'s space: finish the upgrade first")
            live, staged = self._tables()
            self._log_changes(select_sql=f"SELECT item_id FROM items JOIN {staged} USING (row_id) ORDER BY row_id")
            # rows already in the target space needed no transform: carried over unchanged, with their blocks
            self._db.execute(
                f"INSERT INTO {staged} SELECT * FROM {live} v WHERE NOT EXISTS "
                f"(SELECT 1 FROM {staged} s WHERE s.row_id = v.row_id)"
            )
            self._vectors.move_referenced(live, staged)
            self._db.execute(f"DELETE FROM row_extras WHERE field IN ('previous_embedding', {ROLLBACK_FIELDS[1:-1]})")
            if keep_previous is not None:
                self._keep(live, keep_previous, {"previous_embedding": None})
            if keep_rollback:
                self._keep(live, None, {"rollback_embedding": None, "rollback_side_info": None})
            self._vectors.drop_set(live)
            self._db.execute(f"DELETE FROM {live}")
            self._set_meta({**meta, "query_version": str(target_version), "live_vectors": staged})

    def _keep(self, live: str, version: int | None, fields: dict[str, None]) -> None:
        """Inside the switch: the live rows (in ``version``'s space; None: all) keep their embedding
        (``*_embedding`` fields) and side-info (``*_side_info``) as extras, each sealed as that tag's
        own record."""
        where = "" if version is None else "WHERE v.version = ? "
        rows = self._vectors.open_pointers(
            self._db.execute(
                f"SELECT row_id, i.item_id, i.origin_version, v.version, v.via, v.block_id, NULL FROM {live} v "
                f"JOIN items i USING (row_id) {where}ORDER BY row_id",
                () if version is None else (version,),
            ).fetchall()
        )
        for tag, picked in rows_by_tag(rows.tags).items():
            for name in fields:
                values = rows.embeddings if name.endswith("_embedding") else rows.side_infos
                self._extras.insert(
                    name,
                    rows.row_ids[picked].tolist(),
                    [rows.item_ids[i] for i in picked],
                    tag,
                    take_rows(values, picked),
                )


def _not_yet_in(staged: str) -> str:
    """SQL condition on a live vector row ``v``: not in the target version's space (its one
    parameter) and not staged there yet (``staged``: the staged vector table)."""
    return f"v.version != ? AND NOT EXISTS (SELECT 1 FROM {staged} s WHERE s.row_id = v.row_id)"
