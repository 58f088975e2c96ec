"""Every plaintext value of a small device's gallery file changed, one at a time (issue 34 section
2): opening the device, querying, `status`, `check` and `repair` raise nothing but the kit's
errors, `status` reports damage whenever `check` does, and `repair` leaves nothing it reports."""

from __future__ import annotations

import shutil
import sqlite3
import traceback
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from fctkit.edge_runtime import Device
from fctkit.errors import FctkitError
from tests.edge.test_device_damage_edge import _staged

Change = tuple[str, int, str, object]  # table, rowid, column, the value changed


@pytest.fixture
def device_dir(make_device, tiny_bundles, images, monkeypatch) -> Path:
    """Rows of v1 upgraded to v2 in three blocks, a block of v2 rows, labels, queued originals, and
    an upgrade to v3 stopped after its first batch (staged blocks); closed, WAL checkpointed."""
    device = make_device("swept", batch_size=6)
    device.upgrade(tiny_bundles[1])
    for k in range(3):
        device.add(
            images(6, seed=k),
            item_ids=[f"a{k}{i}" for i in range(6)],
            labels=[f"L{k}{i}" for i in range(6)],
            upload=False,
        )
    device.upgrade(tiny_bundles[2])
    device.add(
        images(6, seed=7), item_ids=[f"b{i}" for i in range(6)], labels=[f"M{i}" for i in range(6)], upload=False
    )
    _staged(device, tiny_bundles[3], monkeypatch)
    root = device.root
    device.close()
    with sqlite3.connect(root / "gallery.sqlite") as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return root


def _changes(path: Path) -> Iterator[Change]:
    db = sqlite3.connect(path)
    db.text_factory = bytes
    tables = [t.decode() for (t,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
    for table in tables:
        columns = [c[1].decode() for c in db.execute(f'PRAGMA table_info("{table}")')]
        for row in db.execute(f'SELECT rowid, * FROM "{table}"').fetchall():
            for column, value in zip(columns, row[1:], strict=True):
                typed = db.execute(f'SELECT typeof("{column}") FROM "{table}" WHERE rowid = ?', (row[0],)).fetchone()[0]
                if value is not None:
                    yield (
                        table,
                        row[0],
                        column,
                        (value.decode("utf-8", "surrogateescape") if typed == b"text" else value),
                    )
    db.close()


def _apply(path: Path, change: Change) -> bool:
    """Write the changed value (int +1, one text byte 0xff, one blob byte inverted); False when
    SQLite refuses it (a UNIQUE constraint)."""
    table, rowid, column, value = change
    if isinstance(value, str):
        raw = bytearray(value.encode("utf-8", "surrogateescape") or b"?")
        raw[len(raw) // 2] = 0xFF
        sql, new = f'UPDATE "{table}" SET "{column}" = CAST(? AS TEXT) WHERE rowid = ?', bytes(raw)
    elif isinstance(value, bytes):
        raw = bytearray(value or b"\0")
        raw[len(raw) // 2] ^= 0xFF
        sql, new = f'UPDATE "{table}" SET "{column}" = ? WHERE rowid = ?', bytes(raw)
    else:
        sql, new = f'UPDATE "{table}" SET "{column}" = ? WHERE rowid = ?', value + 1
    with sqlite3.connect(path) as db:
        try:
            db.execute(sql, (new, rowid))
        except sqlite3.IntegrityError:
            return False
    return True


def _session(root: Path, queries: np.ndarray) -> list[str]:
    """What went wrong for the user on a damaged copy: exceptions other than the kit's, and reports that disagree."""
    problems: list[str] = []
    try:
        device = Device.open(root)
    except FctkitError:
        return problems
    device.progress = False
    with device:
        for name, step in (
            ("query", lambda: device.query(queries, k=3)),
            ("status", device.status),
            ("check", device.check),
            ("repair", device.repair),
        ):
            try:
                found = step()
            except FctkitError:
                continue
            except Exception as exc:
                problems.append(f"{name}: {''.join(traceback.format_exception_only(exc)).strip()}")
                continue
            if name == "status":
                status = found
            if (
                name == "check"
                and found["damaged"]
                and not any(status.get(k) for k in ("damaged_settings", "damaged_rows", "damaged"))
            ):
                problems.append("status reports no damage where check does")
            if name == "repair" and found["damaged_after"]:
                problems.append(f"repair leaves damage: {_left(device.check())}")
    return problems


def _left(report: dict) -> str:
    return str({k: v for k, v in report.items() if v and k not in ("rows", "damaged", "next")})[:300]


def test_every_plaintext_value_changed_raises_only_kit_errors(device_dir, images, tmp_path):
    queries = images(2, seed=3)
    work = tmp_path / "work"
    found: dict[str, list[str]] = {}
    tried = 0
    for change in list(_changes(device_dir / "gallery.sqlite")):
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(device_dir, work)
        if not _apply(work / "gallery.sqlite", change):
            continue
        tried += 1
        for problem in _session(work, queries):
            found.setdefault(problem, []).append(f"{change[0]}.{change[2]} (rowid {change[1]})")
    assert not found, "\n".join(f"{p} <- {len(where)}x, e.g. {where[:3]}" for p, where in found.items())
    assert tried > 300  # every table's values were reached (a few changes break a UNIQUE constraint and are skipped)
