"""One exception hierarchy for the kit: catch :class:`FctkitError` for anything fctkit raises
on purpose, or one of its subclasses for what you can handle."""

from __future__ import annotations

from typing import Any


class FctkitError(Exception):
    """Base class of every error fctkit raises deliberately."""


class ConfigError(FctkitError, ValueError):
    """A configuration is invalid: unknown keys, wrong types, out-of-range values."""


class InputError(FctkitError, ValueError):
    """Data handed to the kit is unusable: wrong shapes or dims, NaN/inf, empty sets."""


class ItemError(InputError):
    """Raw items (image files, texts) a bundle's preprocessing cannot embed: a corrupt image, an
    empty text, a text over the declared limit. ``problems`` lists (item id, reason) of each."""

    def __init__(self, message: str, problems: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.problems = problems

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return type(self), (self.args[0], self.problems)


class DataUnavailableError(FctkitError):
    """A dataset or file the kit needs is not installed or not found; the message says how to get it."""


class DependencyError(FctkitError, ImportError):
    """An optional dependency is missing; the message names the extra to install."""


class BundleError(FctkitError):
    """A model bundle failed verification or cannot be built."""


class GateError(FctkitError):
    """An evaluation gate (e.g. ECC) did not pass, so publishing is refused."""


class ExportError(FctkitError):
    """ONNX/TensorRT export failed or its parity check did not hold."""


class BundleFormatError(BundleError):
    """A bundle or its manifest is malformed, incomplete or internally inconsistent."""


class SignatureError(BundleError):
    """A bundle's signature is missing, malformed, or does not verify under the pinned key."""


class HashMismatchError(BundleError):
    """An artifact's bytes differ from the manifest (flipped byte, truncation, swapped file)."""


class RollbackError(BundleError):
    """A bundle's version is not newer than the installed one (rollback or replay)."""


class PublisherKeyError(BundleError):
    """A publisher key file is missing, malformed, too readable, or its passphrase is wrong."""


class TrustError(FctkitError):
    """Trust metadata (a root, a timestamp, a release's signatures) breaks one of the rules of
    :mod:`fctkit.protos.trust`; the message names the file, the rule and what to do."""


class TrustFormatError(TrustError):
    """A trust file is malformed, oversized, or holds unknown or missing keys."""


class ThresholdError(TrustError):
    """Fewer valid signatures than a role's threshold (keys not in the role do not count, nor
    a second signature by one key)."""


class ReleaseSignatureError(ThresholdError, SignatureError):
    """A release's manifest is not signed by a threshold of the root's publisher keys."""


class RootChainError(TrustError):
    """A root does not follow the trusted one (a version skipped or repeated), or does not
    match the fingerprint a device was given."""


class ExpiredMetadataError(TrustError):
    """A root or timestamp expired (beyond the clock tolerance), or the device clock is wrong."""


class MetadataRollbackError(TrustError):
    """A timestamp older than the last one accepted: a replay or a rollback."""


class SnapshotMismatchError(TrustError, HashMismatchError):
    """A manifest is not the one the timestamp names for its version (mix-and-match)."""


def require(module: str, extra: str) -> Any:
    """Import an optional dependency or raise :class:`DependencyError` naming the extra."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise DependencyError(
            f"`{module}` is needed for this and is not installed: pip install 'fctkit[{extra}]' -c constraints.txt"
        ) from exc


class RpcStatusError(FctkitError):
    """A gRPC call ended with a status other than OK: raised by the client library when the
    server answered one, and by server handlers to answer one. ``code`` is the status name
    (e.g. ``"NOT_FOUND"``), ``details`` the server's explanation."""

    def __init__(self, code: str, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return type(self), (self.code, self.details)


class DeviceKeyError(FctkitError):
    """A device key file is missing, too readable, malformed, or its passphrase is wrong,
    or a gallery was opened with a key that is not its own."""


class CorruptRecordError(FctkitError):
    """An encrypted gallery record or vault blob failed authentication: it was modified,
    truncated, swapped with another record, or sealed under another key."""


class GalleryError(FctkitError):
    """An on-device gallery is missing, malformed, or in a state that forbids the request."""


class GalleryDamagedError(GalleryError):
    """The gallery file is damaged where no single row can stand for it: a setting fails its
    authentication or is missing (``settings`` names them), or SQLite cannot read the file.
    ``fctkit device check`` reports all damage; ``fctkit device repair`` restores what it can."""

    def __init__(self, message: str, settings: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.settings = settings

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return type(self), (self.args[0], self.settings)


class DeviceError(FctkitError):
    """A device operation cannot proceed (not initialised, not enrolled, no model installed, …)."""


class NoSpaceError(DeviceError):
    """The device's disk is full (ENOSPC, SQLite's SQLITE_FULL): the write was undone."""
