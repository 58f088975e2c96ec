"""Where the bytes of unfinished vault uploads wait until the last one arrives.

:class:`PartialUploads` is what the Vault needs: how many bytes of an upload are held, dropping
the bytes from an offset on, a writer that appends from an offset, the finished bytes as one
local file (to hash and store), and removal. :class:`PartialFiles` keeps each upload as one
file under ``DATA/tmp/uploads`` (the embedded server);
:class:`fctkit.server.object_store.S3Partials` keeps it as part objects in the bucket, so an
upload begun on one replica resumes on any other.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import AsyncIterator, Callable, Collection
from pathlib import Path
from typing import Protocol

from .streams import FileSink, Sink


class IncompleteUpload(Exception):
    """The held bytes do not reach the upload's end (another replica's write was lost): resume from ``held``."""

    def __init__(self, held: int) -> None:
        super().__init__(f"the server holds {held} contiguous bytes of this upload")
        self.held = held


class PartialUploads(Protocol):
    def held(self, owner_id: str, sha256: str) -> int | None: ...
    def truncate(self, owner_id: str, sha256: str, offset: int) -> None: ...
    def writer(self, owner_id: str, sha256: str, offset: int) -> contextlib.AbstractAsyncContextManager[Sink]: ...
    def assemble(self, owner_id: str, sha256: str, size: int) -> Path: ...
    def finished(self, owner_id: str, sha256: str, assembled: Path) -> None: ...
    def discard(self, owner_id: str, sha256: str) -> None: ...
    def sweep(self, reserved: Callable[[], Collection[tuple[str, str]]]) -> int: ...


def owner_folder(owner_id: str) -> str:
    """The folder (or key prefix) of an owner's partial uploads: a digest, so any owner id is a safe name."""
    return hashlib.sha256(owner_id.encode("utf-8")).hexdigest()[:32]


class PartialFiles:
    """One file per upload: ``<root>/<owner folder>/<sha256>.part``."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def path(self, owner_id: str, sha256: str) -> Path:
        return self.root / owner_folder(owner_id) / f"{sha256}.part"

    def held(self, owner_id: str, sha256: str) -> int | None:
        try:
            return self.path(owner_id, sha256).stat().st_size
        except FileNotFoundError:
            return None

    def truncate(self, owner_id: str, sha256: str, offset: int) -> None:
        """Drop the bytes held from ``offset`` on."""
        with contextlib.suppress(FileNotFoundError):
            os.truncate(self.path(owner_id, sha256), offset)

    @contextlib.asynccontextmanager
    async def writer(self, owner_id: str, sha256: str, offset: int) -> AsyncIterator[Sink]:
        """Append from ``offset`` (bytes after it are dropped first)."""
        partial = self.path(owner_id, sha256)
        partial.parent.mkdir(parents=True, exist_ok=True)
        with partial.open("r+b" if partial.exists() else "wb") as handle:
            handle.truncate(offset)
            handle.seek(offset)
            yield FileSink(handle)

    def assemble(self, owner_id: str, sha256: str, size: int) -> Path:
        partial = self.path(owner_id, sha256)
        held = self.held(owner_id, sha256) or 0
        if held != size:
            raise IncompleteUpload(held)
        return partial

    def finished(self, owner_id: str, sha256: str, assembled: Path) -> None:
        """Nothing left: storing the blob moved the partial file into the content store."""

    def discard(self, owner_id: str, sha256: str) -> None:
        self.path(owner_id, sha256).unlink(missing_ok=True)

    def sweep(self, reserved: Callable[[], Collection[tuple[str, str]]]) -> int:
        """Remove every partial file whose upload is not in ``reserved()`` ((owner id, SHA-256)
        pairs, asked once the files are listed: an upload begun meanwhile is kept); returns how many."""
        partials = list(self.root.glob("*/*.part")) if self.root.exists() else []
        kept = {(owner_folder(owner), sha256) for owner, sha256 in reserved()}
        removed = 0
        for partial in partials:
            if (partial.parent.name, partial.name.removesuffix(".part")) not in kept:
                partial.unlink(missing_ok=True)
                removed += 1
        return removed
