"""Endless paging (issue 51): a server or mirror that keeps answering "there is more" must not
fill a device's memory. GetTrust, ListVersions and the token-paged listings are each bounded in
all as their pages arrive; past a bound the command fails with the kit's error (exit 2, as the
docs say of a refusal) and the device's trust files and gallery are as they were.

The attacker is :class:`~tests.security.mirror.Mirror` in front of a real `fctkit serve --root`
(the world of :mod:`tests.security.test_attacks_loopback`), answering the paged calls with pages
that never end. Each attack runs the real command line in a child process measured by
:mod:`tests.security.memory_probe`: its peak resident memory over what it held once loaded must
stay under a stated figure, and a child that goes over it is ended at once. The bounds: 1,000 roots
in 62.5 MiB of pages, 1,000 versions in 20 MiB, 1,000,000 listed devices or blobs in 128 MiB. The
stated figures (each test's ``limit_mib``) are 48 MiB for small pages and, for pages of 1.5 MiB,
two to five times the bytes a bound lets the client keep (192, 96 and 256 MiB); measured: about 6.5,
90, 40 and 150 MiB. The client before the bounds went over every one of them, or (pages of nothing)
was still paging when killed after :data:`TIMEOUT_S`: each test fails rather than hangs."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from fctkit.edge_runtime import Device
from fctkit.protos import fleet_pb2, registry_pb2
from tests.security.memory_probe import OVER_LIMIT_EXIT
from tests.security.mirror import Mirror
from tests.security.test_attacks_loopback import World, files, release, world  # noqa: F401 (fixtures)
from tests.server.conftest import (  # noqa: F401 (fixtures)
    Backend,
    admin_token_file,
    publisher_key,
    publisher_pub,
    start_server,
)

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120.0
"""How long a refused command may take at most (it takes seconds; the unbounded client never ends)."""
ENDLESS = 4_000_000_000  # the latest root version an attacker claims
REFUSED_EXIT = 2  # `fctkit`: a usage error or a refusal (docs/how-to/recover-a-device.md)


@pytest.fixture(scope="module")
def backend() -> Backend:
    """The bounds are the client's: one storage backend is enough."""
    return Backend("sqlite")


def refused(args: list[str], limit_mib: float, tmp: Path, expected: str) -> None:
    """``fctkit ARGS`` in a child process is refused with ``expected`` in its message and exit 2,
    its memory growing by at most ``limit_mib`` (:mod:`tests.security.memory_probe`). Fails the test
    when the child goes over, or still runs after :data:`TIMEOUT_S`."""
    report = tmp / "memory.json"
    command = [sys.executable, "-m", "tests.security.memory_probe", str(report), str(limit_mib), *args]
    shown = f"`fctkit {' '.join(args)}`"
    try:
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{shown} still ran after {TIMEOUT_S:.0f} s: the client never stops paging")
    if done.returncode == OVER_LIMIT_EXIT:
        pytest.fail(f"{shown} took more than {limit_mib} MiB: {report.read_text()}")
    assert done.returncode == REFUSED_EXIT and expected in done.stderr, done.stderr
    assert "refused (endless" in done.stderr
    measures = json.loads(report.read_text())
    print(f"{shown}: +{measures['growth_mib']:.1f} MiB over {measures['base_mib']:.0f} MiB (limit {limit_mib})")


def device_files(root: Path) -> dict[str, str]:
    """The SHA-256 of every file of the device but the refusal record kept for ``status``."""
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file() and path.name != "trust_refusal.json"
    }


def refused_sync(attacked: World, attack: Callable[[Mirror], None], limit_mib: float, expected: str) -> str:
    """``fctkit device sync``, once the mirror turned into the attacker (``attack``), is
    :func:`refused`; the device is exactly as before. Returns the error class kept for ``status``."""
    root = attacked.device.root
    attacked.device.sync()  # nothing left to upload: the attacked sync has nothing to do before its listing
    attack(attacked.mirror)
    answers = attacked.answers()
    attacked.device.close()
    before = device_files(root)
    try:
        refused(["device", "sync", "--dir", str(root), "--quiet"], limit_mib, attacked.tmp, expected)
        assert device_files(root) == before
    finally:
        attacked.device = Device.open(root)
    assert attacked.answers() == answers
    return json.loads((root / "trust_refusal.json").read_text())["error"]


def endless_roots(size: int, per_page: int) -> Callable[[Mirror], None]:
    """GetTrust answered with ``per_page`` root files of ``size`` bytes, and a latest root ever ahead."""

    def change(answer: registry_pb2.GetTrustResponse) -> None:
        del answer.roots[:]
        answer.roots.extend([b"{" + b" " * (size - 2) + b"}"] * per_page)
        answer.latest_root_version = ENDLESS

    return lambda mirror: mirror.serve_trust(change)


@pytest.mark.parametrize(
    "size, per_page, limit_mib",
    [
        (64, 400, 48),  # the count: 1,000 roots (the third page is refused)
        (1_500_000, 1, 192),  # the bytes: 62.5 MiB (the 44th page is refused; the old client grew ~1.5 MiB a page)
    ],
    ids=["count", "bytes"],
)
def test_endless_root_pages_stop_at_the_chain_limit(world, size, per_page, limit_mib):  # noqa: F811 (a pytest fixture, imported from tests/security/test_attacks_loopback.py)
    attack = endless_roots(size, per_page)
    assert refused_sync(world, attack, limit_mib, "more than 1,000 roots or 62.5 MiB") == "RootChainError"


def endless_versions(mode_bytes: int, per_page: int) -> Callable[[Mirror], None]:
    """ListVersions answered with the real timestamp and ``per_page`` made-up versions, always "more"."""

    def answer(request: bytes, forward: Callable[[bytes], bytes]) -> registry_pb2.ListVersionsResponse:
        after = registry_pb2.ListVersionsRequest.FromString(request).after_version
        page = registry_pb2.ListVersionsResponse.FromString(forward(request))
        del page.versions[:]
        made_up = (registry_pb2.VersionInfo(version=after + i + 1, mode="f" * mode_bytes) for i in range(per_page))
        page.versions.extend(made_up)
        page.more = True
        return page

    return lambda mirror: mirror.take_over("Registry/ListVersions", answer)


@pytest.mark.parametrize(
    "mode_bytes, per_page, limit_mib",
    [
        (16, 100, 48),  # the count: 1,000 versions (the 11th page is refused)
        (1_500_000, 1, 96),  # the bytes: 20 MiB (the 14th page is refused; each kept version held its page)
    ],
    ids=["count", "bytes"],
)
def test_endless_version_pages_stop_at_the_release_limit(world, mode_bytes, per_page, limit_mib):  # noqa: F811 (a pytest fixture, imported from tests/security/test_attacks_loopback.py)
    attack = endless_versions(mode_bytes, per_page)
    assert refused_sync(world, attack, limit_mib, "more than 1,000 versions or 20 MiB") == "TrustFormatError"


def endless_devices(name_bytes: int, per_page: int) -> Callable[[Mirror], None]:
    """ListDevices answered with ``per_page`` made-up devices and always a next page token."""

    def answer(request: bytes, forward: Callable[[bytes], bytes]) -> fleet_pb2.ListDevicesResponse:
        made_up = [fleet_pb2.DeviceInfo(device_id=f"d{i}", name="n" * name_bytes) for i in range(per_page)]
        return fleet_pb2.ListDevicesResponse(devices=made_up, next_page_token="more")

    return lambda mirror: mirror.take_over("Fleet/ListDevices", answer)


@pytest.mark.parametrize(
    "name_bytes, per_page, limit_mib, expected",
    [
        (0, 0, 48, "RESOURCE_EXHAUSTED: the server sent a page of no devices and asks for more"),
        (1_500_000, 1, 256, "RESOURCE_EXHAUSTED: the server sent more than 1,000,000 devices or 128 MiB"),
    ],
    ids=["empty pages", "bytes"],
)
def test_endless_listing_pages_stop_at_the_listing_limit(world, name_bytes, per_page, limit_mib, expected):  # noqa: F811 (a pytest fixture, imported from tests/security/test_attacks_loopback.py)
    endless_devices(name_bytes, per_page)(world.mirror)
    token_file = str(world.server.admin_token_file)
    args = ["admin", "--server", world.mirror.target, "--admin-token-file", token_file, "list-devices"]
    refused(args, limit_mib, world.tmp, expected)
