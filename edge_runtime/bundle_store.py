"""The verified bundles a device has installed (``bundles/vN/``): installing and downloading them
(verified under the pinned publisher key, no rollback), their engines (verified again on first
use) and the upgrade hops they offer, planned as the server plans them."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from fctkit.errors import BundleError, DeviceError
from fctkit.private_files import make_private
from fctkit.protos.bundle import check_version_is_newer, unpack_bundle, verify_bundle
from fctkit.protos.planner import plan_upgrade

from .engine import Engine, EngineConfig
from .upgrade_plan import Hop


class InstalledBundles:
    """The bundles under ``root/bundles``; ``publisher_key()`` gives the pinned key (read when needed)."""

    def __init__(self, root: Path, publisher_key: Callable[[], object], engine_config: EngineConfig) -> None:
        self.root = root
        self.publisher_key = publisher_key
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
            path = self.folder(version)
            if not path.is_dir():
                raise DeviceError(f"bundle v{version} is not installed on this device; sync again")
            bundle = verify_bundle(path, self.publisher_key())
            if bundle.manifest.version != version:
                raise BundleError(f"{path} holds bundle v{bundle.manifest.version}, not v{version}")
            self._engines[version] = Engine(bundle, self.engine_config)
        return self._engines[version]

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
        ``query_version``) and copy it in; returns its version. The very bundle already installed
        (the same signed manifest) of the current or a pending version is accepted again as it
        is, so repeating a command after a crash finishes the job instead of refusing a replay;
        an older version stays a rollback."""
        verified = verify_bundle(source, self.publisher_key())
        version = verified.manifest.version
        dest = self.folder(version)
        if version >= query_version and self._manifest_bytes(version) == verified.manifest_bytes:
            return version
        check_version_is_newer(version, query_version or None)
        if not dest.exists():
            staging = dest.with_name(dest.name + ".partial")
            shutil.rmtree(staging, ignore_errors=True)
            shutil.copytree(verified.root, staging)
            make_private(staging)
            verify_bundle(staging, self.publisher_key())
            os.rename(staging, dest)
        return version

    def _manifest_bytes(self, version: int) -> bytes | None:
        path = self.folder(version) / "manifest.json"
        return path.read_bytes() if path.is_file() else None

    def download(self, client, version: int, query_version: int) -> None:
        """Bring ``version`` from the server (resumable, verified, never older than ``query_version``)."""
        dest = self.folder(version)
        if dest.is_dir():
            verify_bundle(dest, self.publisher_key(), installed_version=query_version or None)
            return
        staging = self.root / "downloads" / f"v{version}"
        client.download_bundle(version, staging, self.publisher_key(), installed_version=query_version or None)
        make_private(staging)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.rename(staging, dest)

    def hops(self, source: int, target: int) -> list[Hop] | None:
        """The cheapest hops from ``source`` to ``target`` over the installed bundles, planned as
        the server plans (:func:`fctkit.protos.planner.plan_upgrade`); None when none connects."""
        planned = plan_upgrade([self.engine(v).manifest for v in self.versions()], source, target)
        return None if planned is None else [
            Hop(h.source_version, h.target_version, h.bundle_version, h.forward.name if h.forward else None,
                h.side_forward.name if h.side_forward else None) for h in planned]

    def install_all(self, bundles: Sequence[str | os.PathLike], query_version: int) -> list[int]:
        """Install bundle folders or ``.tar`` archives in version order; returns their versions."""
        with _unpacked(bundles) as folders:
            versions = {Path(d): verify_bundle(d, self.publisher_key()).manifest.version for d in folders}
            return [self.install(d, query_version) for d in sorted(versions, key=versions.__getitem__)]


@contextlib.contextmanager
def _unpacked(bundles: Sequence[str | os.PathLike]) -> Iterator[list[Path]]:
    """The bundles as folders: a ``.tar`` archive (as `fctkit export` writes and the server
    serves) is unpacked, safely, into a temporary folder that goes afterwards."""
    with tempfile.TemporaryDirectory(prefix="fctkit-bundles-") as scratch:
        yield [unpack_bundle(b, Path(scratch) / f"{i}") if Path(b).is_file() else Path(b) for i, b in enumerate(bundles)]
