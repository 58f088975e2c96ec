"""The encrypted gallery file: one SQLite file (WAL) of sealed vector blocks and per-row records.

:class:`Gallery` (in :mod:`.store`) is the face the device's operations use; its layers, top to
bottom: the upgrade and repair reads and writes (:mod:`.upgrades`, :mod:`.repairs`), the replica
log, per-row extras and the schema-5 block migration (:mod:`.replica_log`, :mod:`.extras`,
:mod:`.block_migration`), the tables (:mod:`.schema`), the sealing of rows and vector blocks
(:mod:`.sealing`, :mod:`.vectors`, :mod:`.blocks`), and the row values and authenticated settings
(:mod:`.rows`, :mod:`.settings`).
"""

from .rows import LoadedRows, NewRow, UpgradedRows, VersionTag
from .store import Gallery

__all__ = ["Gallery", "LoadedRows", "NewRow", "UpgradedRows", "VersionTag"]
