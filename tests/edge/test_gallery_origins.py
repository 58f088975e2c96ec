"""Origin versions in the gallery (issue 48 §3), through :class:`Gallery` on a real SQLite file with
real AES-GCM: rows moved in place to a tag of another origin take it in their per-row entry with
their labels sealed again; rows an earlier revert left with an origin above their version (and
their sealed records not yet pushed) heal in one transaction, all or nothing; status counts every
row once when two tags share one space."""

from __future__ import annotations

import numpy as np
import pytest

from fctkit.edge_runtime.gallery import Gallery
from fctkit.edge_runtime.gallery.replica_log import ReplicaLog
from fctkit.edge_runtime.gallery.rows import NewRow, UpgradedRows, VersionTag

KEY = bytes(range(32))
V1, V3 = VersionTag(1, 1, "native"), VersionTag(3, 3, "native")
BAD = VersionTag(3, 2, "native")  # what reverts wrote for rows added on a withdrawn v3


class Crash(Exception):
    pass


def _rows(prefix: str, n: int, seed: int) -> list[NewRow]:
    rng = np.random.default_rng(seed)
    return [
        NewRow(
            f"{prefix}{i}",
            rng.standard_normal(6).astype(np.float32),
            rng.standard_normal(2).astype(np.float32),
            None if i == 1 else f"L{prefix}{i}",
        )
        for i in range(n)
    ]


def _moved(gallery: Gallery, prefix: str, old: VersionTag, new: VersionTag) -> UpgradedRows:
    rows = gallery.load()
    picked = [k for k, i in enumerate(rows.item_ids) if i.startswith(prefix)]
    return UpgradedRows(
        rows.row_ids[picked].tolist(),
        [rows.item_ids[k] for k in picked],
        old,
        new,
        rows.embeddings[picked],
        rows.side_infos[picked],
    )


@pytest.fixture
def reverted(tmp_path):
    """10 rows of v1 and 4 added at v3, the v3 rows then written back into v2's space keeping origin 3
    (as reverts did) and sealed for pushing, the server not reached yet."""
    with Gallery.create(tmp_path / "g.sqlite", KEY) as g:
        g.set_meta({"query_version": "3"})
        g.add_rows(_rows("old", 10, 1), V1)
        g.add_rows(_rows("new", 4, 2), V3)
        g.revert_rows([_moved(g, "new", V3, BAD)], {"query_version": "2"})
        g.replica_log.seal_changes(100, lambda tag, rows: [(rows.item_ids, b"sealed")])
        yield g


def _outgoing_tags(gallery: Gallery) -> set[VersionTag | None]:
    return {b.tag for b in gallery.replica_log.outgoing(10_000)}


def test_a_row_moved_to_another_origin_takes_it_with_its_label_sealed_again(reverted):
    before = reverted.load()
    reverted.write_upgrades([_moved(reverted, "new", BAD, VersionTag(2, 2, "native"))], staged=False)
    after = reverted.load()
    assert not after.corrupt and after.labels == before.labels and after.item_ids == before.item_ids
    assert after.tags == [V1] * 10 + [VersionTag(2, 2, "native")] * 4
    assert np.array_equal(after.embeddings, before.embeddings)
    origins = dict(reverted._db.execute("SELECT item_id, origin_version FROM items WHERE item_id LIKE 'new%'"))
    assert set(origins.values()) == {2}


def test_rows_with_an_origin_above_their_version_heal_in_one_transaction(reverted, monkeypatch):
    before = reverted.load()
    assert BAD in _outgoing_tags(reverted) and reverted.replica_log.replication_counts()["unpushed"] == 14

    def crash(self):
        raise Crash("killed while healing")

    monkeypatch.setattr(ReplicaLog, "_drop_misplaced_origins", crash)
    with pytest.raises(Crash):
        reverted.heal_origins()
    monkeypatch.undo()
    assert reverted.load().tags == before.tags and BAD in _outgoing_tags(reverted)  # nothing done

    assert reverted.heal_origins() == 4
    after = reverted.load()
    assert not after.corrupt and after.labels == before.labels and after.item_ids == before.item_ids
    assert after.tags == [V1] * 10 + [VersionTag(2, 2, "native")] * 4
    assert np.array_equal(after.embeddings, before.embeddings)
    assert np.array_equal(after.side_infos, before.side_infos)
    assert _outgoing_tags(reverted) == {V1}  # the refused records dropped, their rows logged to be sealed again
    assert reverted._db.execute("SELECT COUNT(*) FROM changes").fetchone()[0] == 4
    assert reverted.heal_origins() == 0  # once


def test_rows_an_upgrade_under_way_staged_keep_their_origin(reverted):
    staged = _moved(reverted, "new", BAD, VersionTag(3, 4, "forward"))
    reverted.write_upgrades([staged], staged=True)
    assert reverted.heal_origins() == 0 and reverted.load().tags[10:] == [BAD] * 4
    assert reverted.tag_counts() == {"v1": 10, "v3->v4 (forward)": 4}  # staged rows at their next tag


def test_status_counts_every_row_once_when_two_tags_share_a_space(tmp_path):
    with Gallery.create(tmp_path / "g.sqlite", KEY) as g:
        g.set_meta({"query_version": "1"})
        g.add_rows(_rows("a", 10, 3), V1)
        backfilled = _moved(g, "a", V1, VersionTag(1, 2, "native"))  # re-embedded by v2 from the original
        g.write_upgrades([backfilled], staged=False)
        g.set_meta({"query_version": "2"})
        g.add_rows(_rows("b", 3, 4), VersionTag(2, 2, "native"))
        assert g.tag_counts() == {"v2": 13} and sum(g.tag_counts().values()) == len(g)
