"""Fixtures for the edge-runtime tests: tiny signed bundles (the server tests' CHAIN of
linear ONNX graphs), devices, and the server tests' real `fctkit serve` process."""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from fctkit.edge_runtime import Device, DeviceSettings  # noqa: E402
from fctkit.export.bundle_builder import build_bundle  # noqa: E402
from fctkit.export.keys import save_public_key  # noqa: E402
from tests.server.conftest import ADMIN_TOKEN, IMAGE_DIM, ServerProcess, _sources, admin_token_file  # noqa: E402,F401 (a fixture)

#: version -> adapters (source, target); v3 also has a direct 1->3 adapter.
TINY_CHAIN: dict[int, tuple[tuple[int, int], ...]] = {1: (), 2: ((1, 2),), 3: ((2, 3), (1, 3))}


@pytest.fixture(scope="session")
def publisher_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(bytes(range(7, 39)))


@pytest.fixture(scope="session")
def publisher_pub(tmp_path_factory, publisher_key) -> Path:
    return save_public_key(publisher_key.public_key(), tmp_path_factory.mktemp("keys") / "publisher.pub")


def device_cli(*args: str) -> subprocess.CompletedProcess:
    """`fctkit device ARGS` in a fresh interpreter where importing torch fails."""
    from tests.foundation.test_packaging import BLOCK_TORCH

    code = BLOCK_TORCH + "from fctkit.cli import main\nmain(sys.argv[1:])\nassert 'torch' not in sys.modules\n"
    return subprocess.run([sys.executable, "-c", code, "device", *args], capture_output=True, text=True)


def device_cli_steps(steps: list[tuple[str, ...]]) -> list[str]:
    """Run each `fctkit device` step (torch blocked); every one must succeed; their stdouts."""
    outputs = []
    for step in steps:
        proc = device_cli(*step)
        assert proc.returncode == 0, (step, proc.stderr)
        outputs.append(proc.stdout)
    return outputs


def flip_stored_byte(db, table: str, column: str, where: str, offset: int) -> int:
    """Invert one byte of ``column`` in the rows of ``table`` matching ``where`` (SQL); returns
    the rows changed. Inverting, not setting a fixed value: a sealed record already holds any
    given byte value at an offset once in 256 runs, and then nothing would be damaged."""
    rows = db.execute(f"SELECT rowid, {column} FROM {table} WHERE {where}").fetchall()
    for rowid, value in rows:
        damaged = bytearray(value)
        damaged[offset] ^= 0xFF
        db.execute(f"UPDATE {table} SET {column} = ? WHERE rowid = ?", (bytes(damaged), rowid))
    return len(rows)


def make_tiny_bundle(
    out: Path, key: Ed25519PrivateKey, version: int, hops: tuple[tuple[int, int], ...], *, mode: str = "forward"
) -> Path:
    sources = _sources(out.parent / f"{out.name}-src", version, hops, IMAGE_DIM)
    ecc = {s.artifact_name: True for s in sources if s.role == "forward"}
    if mode == "compatible" and version > 1:
        ecc["embed"] = True  # a compatible version's new backbone is gated like an adapter
    return build_bundle(
        out,
        version=version,
        parents=(version - 1,) if version > 1 else (),
        mode=mode,
        distance="cosine",
        normalize=True,
        artifacts=sources,
        gate={"cases": {}, "ecc": ecc},
        private_key=key,
    ).root


@pytest.fixture(scope="session")
def tiny_bundles(tmp_path_factory, publisher_key) -> dict[int, Path]:
    """Signed bundle directories v1..v3 of TINY_CHAIN (16-d images, 8-d φ, 4-d ψ)."""
    root = tmp_path_factory.mktemp("tiny-bundles")
    return {v: make_tiny_bundle(root / f"v{v}", publisher_key, v, hops) for v, hops in TINY_CHAIN.items()}


@pytest.fixture
def images() -> Callable[[int, int], np.ndarray]:
    """``images(n, seed)``: n random 16-value 'images' (what the tiny embed graphs take)."""
    return lambda n, seed=0: np.random.default_rng(seed).standard_normal((n, IMAGE_DIM)).astype(np.float32)


@pytest.fixture
def make_device(tmp_path, publisher_pub) -> Callable[..., Device]:
    """``make_device(name, passphrase=None, owner_key_file=None, owner_key_passphrase=None, **settings)``:
    a new device pinning the test publisher key (``settings``: :class:`DeviceSettings` fields)."""
    opened: list[Device] = []

    def make(
        name: str = "dev",
        passphrase: str | None = None,
        *,
        owner_key_file: Path | None = None,
        owner_key_passphrase: str | None = None,
        **settings,
    ) -> Device:
        device = Device.init(
            tmp_path / name,
            passphrase=passphrase,
            publisher_key=publisher_pub,
            settings=DeviceSettings(**settings),
            owner_key_file=owner_key_file,
            owner_key_passphrase=owner_key_passphrase,
        )
        device.progress = False
        opened.append(device)
        return device

    yield make
    for device in opened:
        device.close()


__all__ = [
    "ADMIN_TOKEN",
    "TINY_CHAIN",
    "ServerProcess",
    "device_cli",
    "device_cli_steps",
    "enrolment_code",
    "make_tiny_bundle",
    "publish",
    "start_worker",
]


@pytest.fixture(scope="module")
def edge_server(tmp_path_factory, publisher_pub, admin_token_file):  # noqa: F811 (a pytest fixture, imported from tests/server/conftest.py)
    """A real `fctkit serve` on loopback pinning the edge tests' publisher key."""
    server = ServerProcess(tmp_path_factory.mktemp("edge-server") / "data", publisher_pub, admin_token_file).start()
    yield server
    if server.alive():
        server.stop()


def enrolment_code(server: ServerProcess, label: str = "", *, owner: str = "") -> str:
    """A fresh enrolment code (for ``owner``'s devices; without one, a new owner of its own)."""
    from fctkit.protos.client import FctkitClient

    with FctkitClient(server.target, ADMIN_TOKEN) as admin:
        return admin.create_enrolment_code(label=label, owner=owner).code


def start_worker(script: str, *args: str) -> tuple[subprocess.Popen, queue.Queue]:
    """Run ``python -c script args...``; its stdout lines arrive on the queue (None at its end),
    so a crash test can SIGKILL it right after a given line."""
    process = subprocess.Popen(
        [sys.executable, "-c", script, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in process.stdout:
            lines.put(line.strip())
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return process, lines


def publish(server: ServerProcess, bundle_dir: Path, archive_dir: Path) -> None:
    from fctkit.protos.bundle import pack_bundle
    from fctkit.protos.client import FctkitClient

    archive = pack_bundle(bundle_dir, archive_dir / f"{bundle_dir.name}-{id(bundle_dir)}.tar")
    with FctkitClient(server.target, ADMIN_TOKEN) as admin:
        admin.publish_bundle(archive)
