"""The published versions (``versions``, ``version_artifacts``): each signed manifest, its
co-signatures (``manifest.sigs.json``, empty when none) and the artifacts it names, which live in
the artifacts content store."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .content_store import Contents
from .database import Database
from .rollout_store import Rollout, write_rollout


@dataclass(frozen=True)
class VersionRecord:
    version: int
    manifest: bytes
    signature: bytes
    published_at: str
    co_signatures: bytes = b""


class StaleVersion(Exception):
    """A publish lost: the version is not newer than the latest stored (another replica published meanwhile)."""

    def __init__(self, version: int, latest: int) -> None:
        super().__init__(f"version {version} is not newer than the latest published {latest}")
        self.version, self.latest = version, latest


class VersionStore:
    """The registry's versions on the metadata database and the artifacts store."""

    def __init__(self, db: Database, artifacts: Contents) -> None:
        self._db = db
        self._artifacts = artifacts

    def versions(self) -> list[VersionRecord]:
        rows = self._db.execute(
            "SELECT version, manifest, signature, published_at, co_signatures FROM versions ORDER BY version"
        )
        return [VersionRecord(v, bytes(m), bytes(s), p, bytes(c or b"")) for v, m, s, p, c in rows]

    def latest_version(self) -> int:
        return int(self._db.execute("SELECT COALESCE(MAX(version), 0) FROM versions").fetchone()[0])

    def add_version(
        self, record: VersionRecord, artifact_sha256s: Sequence[str], rollout: Rollout | None = None
    ) -> None:
        """Make a version visible (with ``rollout``: staged), in one transaction. Its artifacts
        must already be in the artifacts store (put them first, e.g. from a worker thread)."""
        missing = [s for s in artifact_sha256s if not self._artifacts.has(s)]
        if missing:
            raise FileNotFoundError(f"artifacts not in the store: {', '.join(missing)}")
        with self._db.transaction("versions"):
            latest = self._db.execute("SELECT COALESCE(MAX(version), 0) FROM versions").fetchone()[0]
            if record.version <= latest:
                raise StaleVersion(record.version, int(latest))
            self._db.execute(
                "INSERT INTO versions (version, manifest, signature, published_at, co_signatures) VALUES (?, ?, ?, ?, ?)",
                (record.version, record.manifest, record.signature, record.published_at, record.co_signatures),
            )
            self._db.executemany(
                "INSERT INTO version_artifacts (version, sha256) VALUES (?, ?)",
                [(record.version, sha256) for sha256 in sorted(set(artifact_sha256s))],
            )
            if rollout is not None:
                write_rollout(self._db, rollout)  # announced before the version: replicas never list it unstaged
            self._db.notify(f"version:{record.version}")

    def referenced_artifacts(self) -> set[str]:
        """The SHA-256 of every artifact a version names (the ones garbage collection keeps)."""
        return {row[0] for row in self._db.execute("SELECT DISTINCT sha256 FROM version_artifacts")}
