"""The gallery's settings (its ``meta`` table), each authenticated under the device key.

A setting is a row ``(key, value, mac)``; ``mac`` is HMAC-SHA256 of ``key NUL value`` under a
key derived from the device key (:meth:`~fctkit.edge_runtime.crypto.Sealer.mac`). A value that
was flipped, edited or swapped with another setting's, and a required setting that is gone,
is found when it is read and named in a :class:`GalleryDamagedError`: nothing the gallery does
rests on an unauthenticated setting. (A whole old copy of the file brings back old settings with
valid MACs: like the rows, settings are bound to the key, not to time.)

Galleries of schema 3 and older had no MACs: they get them, over the values as found, in the
one transaction that migrates them (:func:`add_macs`).
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Callable, Iterable, Iterator

from fctkit.errors import GalleryDamagedError

from ..crypto import Sealer

#: must be present in every gallery of schema 4 (the others are optional: absent = not set)
REQUIRED = ("schema_version", "gallery_id", "key_check", "query_version", "live_vectors", "replica_cursor", "row_count")
#: without these the gallery cannot be opened at all
ESSENTIAL = ("schema_version", "gallery_id", "key_check")
#: every setting name but the numbered ``uncertainty:vN`` (a damaged name is recognised by its MAC)
KNOWN = (*REQUIRED, "upgrade", "transition", "backfill", "upgrade_health", "rollback", "withdrawn", "revert")
#: what to do about a gallery that cannot be opened (the CLI's repair cuts a message at "; restore a backup")
RESTORE_OR_REBUILD = (
    "restore a backup of the device directory, or rebuild it from the owner's replica "
    "(`fctkit device repair --dir DIR` prints the steps for this device)"
)
RECOVERED_BYTES = 512  # longest value whose damaged byte is searched for (about 0.1 s per 100 bytes)


def stored_name(value: object) -> str:
    """A name read from a text column whatever a damaged byte made of it (a BLOB, a number)."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "surrogateescape")
    return value if isinstance(value, str) else str(value)


def setting_mac(sealer: Sealer, key: str, value: str) -> bytes:
    return sealer.mac(
        b"fctkit-setting/1\0"
        + key.encode("utf-8", "surrogateescape")
        + b"\0"
        + value.encode("utf-8", "surrogateescape")
    )


def authentic(sealer: Sealer, key: str, value: object, mac: object) -> bool:
    return (
        isinstance(key, str)
        and isinstance(value, str)
        and isinstance(mac, bytes)
        and setting_mac(sealer, key, value) == mac
    )


class GallerySettings:
    """The settings of one gallery connection; writes join the caller's transaction."""

    def __init__(self, db: sqlite3.Connection, sealer: Sealer, path: object) -> None:
        self._db = db
        self._sealer = sealer
        self._path = path
        self._override: dict[str, str | None] = {}

    @contextlib.contextmanager
    def override(self, values: dict[str, str | None]) -> Iterator[None]:
        """Read ``values`` instead of the stored settings meanwhile (repair reads the rows with
        the settings it derived before it writes them)."""
        self._override = dict(values)
        try:
            yield
        finally:
            self._override = {}

    def get(self, key: str, default: str | None = None) -> str | None:
        """The setting's value (``default`` when not set); a damaged one, or a missing
        :data:`REQUIRED` one, raises :class:`GalleryDamagedError`."""
        if key in self._override:
            value = self._override[key]
            return default if value is None else value
        row = self._db.execute("SELECT value, mac FROM meta WHERE key = ?", (key,)).fetchone()
        if row is None:
            if key in REQUIRED:
                raise self.error([key])
            return default
        if not authentic(self._sealer, key, *row):
            raise self.error([key])
        return row[0]

    def put(self, values: dict[str, str | None]) -> None:
        """Set (``None``: delete) settings, each with its MAC; call inside a transaction."""
        for key, value in values.items():
            # whatever type a damaged byte left the name as (repair drops or rewrites it): matched as its bytes
            self._db.execute("DELETE FROM meta WHERE CAST(key AS BLOB) = ?", (key.encode("utf-8", "surrogateescape"),))
            if value is not None:
                self._db.execute(
                    "INSERT INTO meta (key, value, mac) VALUES (?, ?, ?)",
                    (key, value, setting_mac(self._sealer, key, value)),
                )

    def stored(self, key: str) -> str | None:
        """The value stored under ``key`` as read, unauthenticated (repair's evidence, never used as a setting)."""
        row = self._db.execute("SELECT value FROM meta WHERE CAST(key AS BLOB) = ?", (key.encode(),)).fetchone()
        return None if row is None else stored_name(row[0])

    def damaged(self) -> list[str]:
        """Every setting that fails its MAC and every required one that is missing (a damaged
        name is listed as read, e.g. with ``\\udcff`` for a byte that is not UTF-8)."""
        rows = self._db.execute("SELECT key, value, mac FROM meta").fetchall()
        bad = [stored_name(key) for key, value, mac in rows if not authentic(self._sealer, key, value, mac)]
        present = {key for key, _, _ in rows}
        return sorted({*bad, *(k for k in REQUIRED if k not in present)})

    def opened_essentials(self) -> dict[str, str]:
        """The :data:`ESSENTIAL` settings as stored, for a gallery that opened: opening vouched for
        them (their MACs, one recovered byte, or the key check), so repair can seal them again."""
        rows = self._db.execute(
            f"SELECT key, value FROM meta WHERE key IN ({','.join('?' * len(ESSENTIAL))})", ESSENTIAL
        )
        return {key: value for key, value in rows if isinstance(value, str)}

    def recovered(self) -> dict[str, str]:
        """Damaged settings whose MAC still authenticates them, by name: a name that is damaged
        (its MAC holds under a known name), a name or value read back as another type, or one
        damaged byte of the value (the one byte whose correction the MAC accepts)."""
        found: dict[str, str] = {}
        for key, value, mac in self._db.execute("SELECT key, value, mac FROM meta").fetchall():
            if not isinstance(mac, bytes) or authentic(self._sealer, key, value, mac):
                continue
            name, text = stored_name(key), stored_name(value)
            holds = [k for k in ((name,) if name in KNOWN else KNOWN) if setting_mac(self._sealer, k, text) == mac]
            if holds:
                found[holds[0]] = text
            elif name in KNOWN:

                def mac_holds(value: str, name: str = name, mac: bytes = mac) -> bool:
                    return setting_mac(self._sealer, name, value) == mac

                fixed = _one_byte_fixed(text, mac_holds)
                if fixed is not None:
                    found[name] = fixed
        return found

    def error(self, keys: Iterable[str]) -> GalleryDamagedError:
        keys = tuple(keys)
        if set(keys) & set(ESSENTIAL):
            advice = f"the gallery cannot be opened; {RESTORE_OR_REBUILD}"
        else:
            advice = (
                "run `fctkit device repair --dir DIR`: it derives them again where it can, and otherwise says how "
                "to rebuild the gallery from the owner's replica"
            )
        return GalleryDamagedError(
            f"{self._path}: gallery setting(s) {', '.join(keys)} failed authentication or are "
            f"missing (the file was modified or damaged); nothing was changed; {advice}",
            keys,
        )


def _one_byte_fixed(text: str, holds: Callable[[str], bool]) -> str | None:
    """``text`` with one byte changed such that ``holds`` accepts it (None: no such byte)."""
    raw = text.encode("utf-8", "surrogateescape")
    for at in range(min(len(raw), RECOVERED_BYTES)):
        for byte in range(256):
            candidate = raw[:at] + bytes([byte]) + raw[at + 1 :]
            try:
                value = candidate.decode("utf-8")
            except UnicodeDecodeError:
                continue
            if byte != raw[at] and holds(value):
                return value
    return None


def add_macs(db: sqlite3.Connection, sealer: Sealer) -> None:
    """Schema 3 -> 4 (inside the caller's transaction): a MAC for every setting as found, and the
    authenticated row count."""
    db.execute("ALTER TABLE meta ADD COLUMN mac BLOB")
    settings = GallerySettings(db, sealer, "")
    values = dict(db.execute("SELECT key, value FROM meta").fetchall())
    values["row_count"] = str(db.execute("SELECT COUNT(*) FROM items").fetchone()[0])
    settings.put(values)
