"""The trust calls of :class:`~fctkit.protos.client.FctkitClient`: the version list with the
timestamp it carries, the roots and timestamp (GetTrust), and publishing a root. A mixin: the
client supplies ``_unary`` and the Registry stub.

Both listings page, and each is bounded in all as its pages arrive (:mod:`.paging`): GetTrust by
the chain limit of a root walk (:data:`ROOT_PAGES`), ListVersions by the most releases a
timestamp may name (:data:`VERSION_PAGES`). A server that goes past a bound is refused with the
:class:`~fctkit.errors.TrustError` its metadata would earn, and nothing it sent is kept."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from fctkit.errors import RootChainError, TrustFormatError

from . import limits, registry_pb2
from .paging import PagingBound, gather_pages
from .trust import MAX_RELEASES, MAX_ROOT_BYTES, MAX_ROOT_CHAIN

ROOT_PAGES = PagingBound("roots", MAX_ROOT_CHAIN, MAX_ROOT_CHAIN * MAX_ROOT_BYTES, RootChainError)
"""GetTrust: at most the 1,000 roots one walk accepts, in at most 1,000 × 64 KiB (62.5 MiB) of pages."""
VERSION_PAGES = PagingBound(
    "versions",
    MAX_RELEASES,
    MAX_RELEASES // limits.MAX_VERSIONS_PAGE * limits.MAX_MESSAGE_BYTES,
    TrustFormatError,
)
"""ListVersions: at most the 1,000 releases a timestamp may name, in at most the 10 full pages
of 2 MiB that carry them (20 MiB)."""


@dataclass(frozen=True)
class TrustUpdate:
    """What ``GetTrust`` answered: root files after the asked version, the timestamp file, and
    the latest root version the server holds (all unverified bytes)."""

    roots: list[bytes]
    timestamp: bytes
    latest_root_version: int


@dataclass(frozen=True)
class VersionListing:
    """What ``ListVersions`` answered over all its pages: the versions, and from a server with a
    root the current timestamp and latest root version (unverified bytes; empty and 0 otherwise),
    the signed withdrawals and the (unsigned) confirmed versions."""

    versions: list[registry_pb2.VersionInfo]
    timestamp: bytes
    latest_root_version: int
    withdrawals: list[bytes] = field(default_factory=list)
    confirmed_versions: list[int] = field(default_factory=list)
    # the server's timestamp is the one the caller said it holds (``timestamp`` is then empty)
    timestamp_unchanged: bool = False


class TrustCalls:
    """``list_versions``, ``version_listing``, ``get_trust`` and ``publish_root``."""

    registry: Any
    _unary: Callable[..., Any]

    def list_versions(self, after_version: int = 0) -> list[registry_pb2.VersionInfo]:
        """Every published version after ``after_version``, in order (all pages)."""
        return self.version_listing(after_version).versions

    def version_listing(self, after_version: int = 0, known_timestamp_version: int = 0) -> VersionListing:
        """Every published version after ``after_version`` (all pages, within :data:`VERSION_PAGES`),
        with the timestamp and latest root version the first page carries (a server with a root;
        unverified bytes). ``known_timestamp_version``: the timestamp the caller holds; when it is
        still the current one the listing says so (``timestamp_unchanged``) instead of carrying it."""

        def ask(
            previous: registry_pb2.ListVersionsResponse | None, kept: int
        ) -> registry_pb2.ListVersionsResponse | None:
            if previous is not None and not (previous.more and previous.versions):
                return None
            after = after_version if previous is None else previous.versions[-1].version
            request = registry_pb2.ListVersionsRequest(
                after_version=after, known_timestamp_version=known_timestamp_version
            )
            return cast(registry_pb2.ListVersionsResponse, self._unary(self.registry.ListVersions, request))

        pages = gather_pages(ask, lambda page: page.versions, VERSION_PAGES)
        first = pages.first
        return VersionListing(
            pages.items,
            first.timestamp,
            first.latest_root_version,
            list(first.withdrawals),
            list(first.confirmed_versions),
            first.timestamp_unchanged,
        )

    def get_trust(self, after_root_version: int = 0) -> TrustUpdate:
        """The roots after ``after_root_version`` (every page, within :data:`ROOT_PAGES`) and the
        current signed timestamp. Nothing here is verified: the device walks the roots and checks
        the timestamp."""

        def ask(previous: registry_pb2.GetTrustResponse | None, kept: int) -> registry_pb2.GetTrustResponse | None:
            if previous is not None and (
                not previous.roots or after_root_version + kept >= previous.latest_root_version
            ):
                return None
            request = registry_pb2.GetTrustRequest(after_root_version=after_root_version + kept)
            return cast(registry_pb2.GetTrustResponse, self._unary(self.registry.GetTrust, request))

        pages = gather_pages(ask, lambda page: page.roots, ROOT_PAGES)
        return TrustUpdate(pages.items, pages.last.timestamp, pages.last.latest_root_version)

    def publish_root(self, root: bytes) -> registry_pb2.PublishRootResponse:
        """Admin: add the next root (``root.<N+1>.json``) to the server's chain."""
        return cast(
            registry_pb2.PublishRootResponse,
            self._unary(self.registry.PublishRoot, registry_pb2.PublishRootRequest(root=root), retry=False),
        )
