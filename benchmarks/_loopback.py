"""Shared by the edge benchmarks: the demo's real ``fctkit serve`` subprocess on loopback
(:class:`fctkit.demo.DemoServer`) with its own data directory and a fresh publisher key, plus
helpers for enrolment codes and publishing, and the benchmarks' report step."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fctkit.demo import DemoServer
from fctkit.errors import FctkitError


class LoopbackServer(DemoServer):
    """``with LoopbackServer(work) as server:`` — ``server.target``, ``server.key`` (the
    publisher's private key), ``server.publisher_pub``, ``server.code(owner)``, ``server.publish(dir)``."""

    def __init__(self, work: Path, *extra_args: str, root_of_trust: bool = False, storage: Sequence[str] = ()) -> None:
        """``root_of_trust``: serve a root (one root key; the publisher key, threshold 1; a
        timestamp key) instead of the bare publisher key; ``server.fingerprint`` is its fingerprint.
        ``storage``: `fctkit serve` storage arguments in place of ``--data`` (``--database URL
        --object-store s3://BUCKET/PREFIX``, the scale-out backend); empty: a data directory."""
        from fctkit.export.keys import save_public_key

        self.storage = tuple(storage)
        self.work = Path(work)
        self.work.mkdir(parents=True, exist_ok=True)
        self.key = Ed25519PrivateKey.generate()
        publisher_pub = save_public_key(self.key.public_key(), self.work / "publisher.pub")
        self.fingerprint = ""
        if root_of_trust:
            extra_args = (*self._root_args(publisher_pub), *extra_args)
        super().__init__(self.work / "server-data", None if root_of_trust else publisher_pub, extra_args)

    def _root_args(self, publisher_pub: Path) -> tuple[str, ...]:
        from fctkit.export.keys import generate_keys, init_root, load_public_key
        from fctkit.protos.trust import root_fingerprint

        timestamp_key, timestamp_pub = generate_keys(self.work / "timestamp")
        root_file, signed, _ = init_root(self.work / "root", root_keys=1, root_threshold=1,
                                         publisher_keys=[load_public_key(publisher_pub)],
                                         timestamp_keys=[load_public_key(timestamp_pub)])
        self.fingerprint = root_fingerprint(signed)
        return ("--root", str(root_file), "--timestamp-key", str(timestamp_key))

    def __enter__(self) -> LoopbackServer:
        return self.start(timeout_s=60)

    def start(self, timeout_s: float = 120.0) -> LoopbackServer:
        """The demo's start for a data directory; with ``storage``, the same launch on that storage
        (DemoServer always passes ``--data``, which the server refuses next to ``--database``)."""
        if not self.storage:
            return super().start(timeout_s)
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_urlsafe(32) + "\n")
        command = [sys.executable, "-m", "fctkit.cli", "serve", *self.storage, "--port", "0",
                   *(("--publisher-key", str(self.publisher_pub)) if self.publisher_pub else ()),
                   "--admin-token-file", str(self.token_file), "--shutdown-grace", "2", *self.extra_args]
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, stdin=subprocess.DEVNULL,
                                            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            events = [json.loads(line) for line in self.log_path.read_text(errors="replace").splitlines()
                      if line.startswith("{") and '"listening"' in line]
            if ports := [int(e["port"]) for e in events if e.get("event") == "listening"]:
                self.port = ports[0]
                return self
            if self.process.poll() is not None:
                raise FctkitError(f"the server exited with {self.process.returncode}; see {self.log_path}")
            time.sleep(0.05)
        raise FctkitError(f"the server did not start within {timeout_s:.0f} s; see {self.log_path}")

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def code(self, owner: str = "") -> str:
        with self.admin() as admin:
            return admin.create_enrolment_code(owner=owner).code

    def publish(self, bundle_dir: Path) -> None:
        from fctkit.protos.bundle import pack_bundle

        archive = pack_bundle(bundle_dir, self.work / f"{Path(bundle_dir).name}-{os.getpid()}.tar")
        with self.admin() as admin:
            admin.publish_bundle(archive)


def report(result: dict, table: str, markdown: Path | None) -> None:
    """Print the measured figures (JSON) and their table; also append the table to ``markdown``."""
    print(json.dumps(result, indent=2))
    print(table)
    if markdown:
        with markdown.open("a") as fh:
            fh.write(table + "\n")
