"""The verified bundles a device has installed (``bundles/vN/``): installing and downloading them
(signed by the publisher threshold of the device's current root, or its pinned publisher key; a
download matches the accepted timestamp; no rollback), their engines (verified again on first
use, under any root the device has accepted) and the upgrade hops they offer, planned as the
server plans them."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

from fctkit.errors import BundleError, DeviceError, FctkitError, TrustError
from fctkit.private_files import make_private
from fctkit.protos.bundle import (
    MANIFEST_FILE,
    SIGNATURE_FILE,
    VerifiedBundle,
    check_version_is_newer,
    unpack_bundle,
    verify_bundle,
)
from fctkit.protos.bundle_vocabulary import MAX_MANIFEST_BYTES, SIGNATURE_SIZE, SIGNATURES_FILE
from fctkit.protos.durable_files import read_regular_file
from fctkit.protos.planner import plan_upgrade
from fctkit.protos.trust import MAX_SIGNATURES_BYTES, ReleaseTrust, Timestamp, verify_release_manifest

from .engine import Engine, EngineConfig
from .sqlite_file import is_no_space, no_space
from .upgrade_plan import Hop

REINSTALL = (
    "put the published bundle back: `fctkit device repair --dir DIR` downloads it again from the server, or "
    "`fctkit device upgrade --dir DIR --bundle BUNDLE` takes it from a folder or .tar"
)


def damaged_bundle(version: int, why: str) -> str:
    """An installed bundle that fails verification: what to do first (it was verified when installed, so
    its files were damaged since), then what the check said (whose own advice is for a download)."""
    return f"the installed bundle v{version} is damaged: {REINSTALL} (its check said: {why})"


class BundleTrust(Protocol):
    """What releases must be signed by (:class:`~.device_trust.DeviceTrust`, read when needed)."""

    def release_trust(self) -> ReleaseTrust:
        """To install a bundle: the current root (or the pinned key)."""

    def accepted_trusts(self) -> list[ReleaseTrust]:
        """To load an installed one: any of these."""

    def snapshot(self) -> Timestamp | None:
        """The accepted timestamp a download must match (None: no root)."""


class InstalledBundles:
    """The bundles under ``root/bundles``, checked under ``trust``."""

    def __init__(self, root: Path, trust: BundleTrust, engine_config: EngineConfig) -> None:
        self.root = root
        self.trust = trust
        self.engine_config = engine_config
        self._engines: dict[int, Engine] = {}

    def folder(self, version: int) -> Path:
        return self.root / "bundles" / f"v{version}"

    def versions(self) -> list[int]:
        """The versions whose verified bundles are installed."""
        folder = self.root / "bundles"
        names = [p.name for p in folder.iterdir() if p.is_dir()] if folder.is_dir() else []
        return sorted(int(n[1:]) for n in names if n.startswith("v") and n[1:].isdigit())

    def engine(self, version: int) -> Engine:
        """The engine of an installed bundle, verified on first use."""
        if version == 0:
            raise DeviceError("no model is installed yet: run `fctkit device sync` (or `upgrade --bundle DIR`)")
        if version not in self._engines:
            if not self.folder(version).is_dir():
                raise DeviceError(f"bundle v{version} is not installed on this device; {REINSTALL}")
            try:
                bundle = self._verified(version)
            except (BundleError, OSError) as exc:
                raise BundleError(damaged_bundle(version, str(exc))) from None
            self._engines[version] = Engine(bundle, self.engine_config)
        return self._engines[version]

    def _verified(self, version: int) -> VerifiedBundle:
        path = self.folder(version)
        bundle = verify_bundle(path, self._installed_trust(path))
        if bundle.manifest.version != version:
            raise BundleError(f"{path} holds bundle v{bundle.manifest.version}, not v{version}")
        return bundle

    def damaged(self, needed: Callable[[], Sequence[int]] = tuple) -> dict[int, str]:
        """Installed bundles whose files fail verification against their signed manifest, and
        ``needed()`` versions not installed (none when it raises: a damaged setting, reported
        on its own): version -> what is wrong (`fctkit device check`)."""
        found = {
            v: f"bundle v{v} is not installed; {REINSTALL}"
            for v in _versions(needed)
            if v and not self.folder(v).is_dir()
        }
        found.update({v: damaged_bundle(v, why) for v in self.versions() if (why := self._damage(v)) is not None})
        return dict(sorted(found.items()))

    def _damage(self, version: int) -> str | None:
        """Why the installed ``version`` fails verification, or None when it is intact."""
        try:
            self._verified(version)
        except (BundleError, OSError) as exc:
            return str(exc)
        except TrustError:  # the device's trust files, not the bundle: `status` reports them
            return None
        return None

    def fetch_again(self, connect: Callable[[], Any], needed: Callable[[], Sequence[int]] = tuple) -> dict[int, str]:
        """Download each damaged (or needed and missing) bundle again from the server and put it
        in place (only the very signed manifest installed: :meth:`install`'s rule); returns those
        still damaged, each with why."""
        left = self.damaged(needed)
        if not left:
            return left
        with connect() as client:
            for version in list(left):
                staging = self.root / "downloads" / f"v{version}"
                try:
                    self._install(self._fetch(client, version, staging), max(_versions(needed), default=0))
                    del left[version]
                except (FctkitError, OSError) as exc:  # e.g. the server away, or a full disk
                    left[version] += f" (downloading it again failed: {exc})"
                finally:
                    shutil.rmtree(staging, ignore_errors=True)
        return left

    def loaded_versions(self) -> list[int]:
        """The versions whose engines are loaded in this process."""
        return sorted(self._engines)

    def unload(self, version: int) -> None:
        self._engines.pop(version, None)

    def manifest(self, version: int):
        """The manifest of ``version`` when it is installed, else None."""
        return self.engine(version).manifest if version in self.versions() else None

    def install(self, source: str | os.PathLike, query_version: int) -> int:
        """Verify a local bundle directory under the pinned key (signature, hashes, newer than
        ``query_version``) and copy it in; returns its version (:meth:`_install`)."""
        return self._install(verify_bundle(source, self.trust.release_trust()), query_version)

    def _install(self, verified: VerifiedBundle, query_version: int) -> int:
        """The very bundle already installed (the same signed manifest, or signature: one flipped
        byte cannot change both) is accepted again, whatever its version: repeating a command
        after a crash finishes the job, and a damaged installed copy is replaced by the signed
        bytes; so is the gallery's own version when its folder is gone. Any other bundle must be
        newer than ``query_version`` (an identical older one is still reported as a rollback)."""
        version = verified.manifest.version
        dest = self.folder(version)
        same = self._holds_signed(version, verified)
        if not same and not (version == query_version and not dest.exists()):
            check_version_is_newer(version, query_version or None)
        if dest.exists() and (not same or self._damage(version) is None):
            if same and version < query_version:
                check_version_is_newer(version, query_version)
            return version
        self._put(version, verified.root)
        return version

    def _holds_signed(self, version: int, verified: VerifiedBundle) -> bool:
        folder = self.folder(version)
        return any(
            (folder / name).is_file() and (folder / name).read_bytes() == value
            for name, value in ((MANIFEST_FILE, verified.manifest_bytes), (SIGNATURE_FILE, verified.signature))
        )

    def _put(self, version: int, source: Path) -> None:
        """Copy a verified bundle into ``bundles/vN`` (verified again there), replacing what was there."""
        dest = self.folder(version)
        staging, old = dest.with_name(dest.name + ".partial"), dest.with_name(dest.name + ".damaged")
        for leftover in (staging, old):
            shutil.rmtree(leftover, ignore_errors=True)
        _copy_tree(source, staging)
        make_private(staging)
        verify_bundle(staging, self.trust.release_trust())
        if dest.exists():
            os.rename(dest, old)
        os.rename(staging, dest)
        shutil.rmtree(old, ignore_errors=True)
        self._engines.pop(version, None)

    def download(self, client, version: int, query_version: int) -> None:
        """Bring ``version`` from the server (resumable, verified, never older than ``query_version``)."""
        dest = self.folder(version)
        if dest.is_dir():
            verify_bundle(dest, self._installed_trust(dest), installed_version=query_version or None)
            return
        staging = self.root / "downloads" / f"v{version}"
        try:
            self._fetch(client, version, staging, query_version or None)
        except OSError as exc:
            if is_no_space(exc):  # the partial download stays: the next try resumes it
                raise no_space(staging.parent, f"downloading bundle v{version}") from None
            raise
        make_private(staging)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.rename(staging, dest)

    def _fetch(self, client, version: int, staging: Path, installed_version: int | None = None) -> VerifiedBundle:
        """Download ``version`` as the device installs it: the manifest the accepted timestamp
        names, signed by the current root's publisher threshold (or the pinned key)."""
        return client.download_bundle(
            version,
            staging,
            self.trust.release_trust(),
            installed_version=installed_version,
            timestamp=self.trust.snapshot(),
        )

    def _installed_trust(self, folder: Path) -> ReleaseTrust:
        """The first accepted root (or key) the installed bundle in ``folder`` is signed for; the
        current one when none is (its verification then says why). Checking signatures alone
        first keeps the artifacts' hashes to one pass."""
        trusts = self.trust.accepted_trusts()
        try:
            signed = (
                read_regular_file(folder / MANIFEST_FILE, MAX_MANIFEST_BYTES),
                read_regular_file(folder / SIGNATURE_FILE, SIGNATURE_SIZE + 1),
            )
            co_signatures = folder / SIGNATURES_FILE
            extra = read_regular_file(co_signatures, MAX_SIGNATURES_BYTES + 1) if co_signatures.exists() else None
        except (OSError, BundleError):
            return trusts[0]
        for trust in trusts:
            try:
                verify_release_manifest(*signed, extra, trust)
            except FctkitError:
                continue
            return trust
        return trusts[0]

    def hops(self, source: int, target: int) -> list[Hop] | None:
        """The cheapest hops from ``source`` to ``target`` over the installed bundles, planned as
        the server plans (:func:`fctkit.protos.planner.plan_upgrade`); None when none connects."""
        planned = plan_upgrade([self.engine(v).manifest for v in self.versions()], source, target)
        return (
            None
            if planned is None
            else [
                Hop(
                    h.source_version,
                    h.target_version,
                    h.bundle_version,
                    h.forward.name if h.forward else None,
                    h.side_forward.name if h.side_forward else None,
                )
                for h in planned
            ]
        )

    @staticmethod
    def bytes_of(bundles: Sequence[str | os.PathLike]) -> int:
        """The bytes of bundle folders or archives as offered (what installing them takes at most)."""
        paths = [Path(b) for b in bundles]
        return sum(f.stat().st_size for p in paths for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file())

    def install_all(
        self, bundles: Sequence[str | os.PathLike], query_version: int, room: Callable[[int], None] = lambda more: None
    ) -> list[int]:
        """Install bundle folders or ``.tar`` archives in version order; returns their versions. Once
        they verified, and only when there is work to do (a bundle to copy in, or one newer than
        ``query_version``), ``room(bytes to copy)`` may refuse before anything is written."""
        with _unpacked(bundles) as folders:
            verified = {Path(d): verify_bundle(d, self.trust.release_trust()) for d in folders}
            new = [d for d, bundle in verified.items() if not self._holds_intact(bundle)]
            if new or max((b.manifest.version for b in verified.values()), default=0) > query_version:
                room(self.bytes_of(new))
            return [
                self.install(d, query_version) for d in sorted(verified, key=lambda d: verified[d].manifest.version)
            ]

    def _holds_intact(self, verified: VerifiedBundle) -> bool:
        """Whether this very signed bundle is installed already, intact (installing it again copies nothing)."""
        version = verified.manifest.version
        return self._holds_signed(version, verified) and self._damage(version) is None


def _versions(needed: Callable[[], Sequence[int]]) -> list[int]:
    try:
        return list(needed())
    except FctkitError:
        return []


def _copy_tree(source: Path, dest: Path) -> None:
    """Copy a bundle folder; on a full disk the partial copy goes and the error says so."""
    try:
        shutil.copytree(source, dest)
    except OSError as exc:  # shutil.Error included
        shutil.rmtree(dest, ignore_errors=True)
        if is_no_space(exc):
            raise no_space(dest.parent, "copying the bundle in", InstalledBundles.bytes_of([source])) from None
        raise


@contextlib.contextmanager
def _unpacked(bundles: Sequence[str | os.PathLike]) -> Iterator[list[Path]]:
    """The bundles as folders: a ``.tar`` archive (as `fctkit export` writes and the server
    serves) is unpacked, safely, into a temporary folder that goes afterwards."""
    with tempfile.TemporaryDirectory(prefix="fctkit-bundles-") as scratch:
        yield [
            unpack_bundle(b, Path(scratch) / f"{i}") if Path(b).is_file() else Path(b) for i, b in enumerate(bundles)
        ]
