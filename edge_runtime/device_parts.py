"""What a device's operations (backfill, replication) are handed: the gallery, the installed
bundles, the two keys' sealers and a way to reach the server. :class:`~.device.Device` builds it;
the operations never reach back into the device."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from fctkit.errors import RpcStatusError

from .bundle_store import InstalledBundles
from .crypto import Sealer
from .engine import Engine
from .gallery import Gallery
from .vault_blob import open_image


@dataclass(frozen=True)
class DeviceParts:
    """``connect(attempts=…)`` opens a client to the server (a context manager)."""

    gallery: Gallery
    bundles: InstalledBundles
    sealer: Sealer
    owner_sealer: Sealer
    owner_id: str | None
    connect: Callable[..., Any]
    progress: bool = True

    @property
    def version(self) -> int:
        """The version answering queries (0: none yet)."""
        return self.gallery.query_version

    def pending_versions(self) -> list[int]:
        """Installed versions newer than the one answering queries and no upgrade under way: a
        bundle installed by an upgrade that stopped before it began (`fctkit device upgrade` applies it)."""
        if self.gallery.upgrade_state is not None:
            return []
        return [v for v in self.bundles.versions() if v > self.version]

    def engine(self, version: int | None = None) -> Engine:
        return self.bundles.engine(self.version if version is None else version)

    def flush_outbox(self, *, attempts: int = 2) -> tuple[int, int]:
        """Upload queued sealed originals to the vault; returns (uploaded, still queued).
        When the server cannot be reached the queue is kept for the next try."""
        queued = self.gallery.replica_log.outbox()
        uploaded = 0
        if not queued:
            return 0, 0
        with self.connect(attempts=attempts) as client:
            for item_id, blob in queued:
                try:
                    transfer = client.upload_blob(blob, item_id)
                except RpcStatusError as exc:
                    if exc.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED", "ABORTED"):
                        break
                    raise
                self.gallery.replica_log.mark_uploaded(item_id, transfer.sha256)
                uploaded += 1
        return uploaded, self.gallery.replica_log.outbox_size()

    def open_original(self, item_id: str, blob: bytes) -> np.ndarray:
        """Open a sealed original from the vault (sealed by any device of the owner)."""
        return open_image(self.owner_sealer, item_id, blob, device=self.sealer, gallery_id=self.gallery.gallery_id)
