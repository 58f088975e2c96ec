"""Shared by the edge benchmarks: the demo's real ``fctkit serve`` subprocess on loopback
(:class:`fctkit.demo.DemoServer`) with its own data directory and a fresh publisher key, plus
helpers for enrolment codes and publishing, and the benchmarks' report step."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fctkit.demo import DemoServer


class LoopbackServer(DemoServer):
    """``with LoopbackServer(work) as server:`` — ``server.target``, ``server.key`` (the
    publisher's private key), ``server.publisher_pub``, ``server.code(owner)``, ``server.publish(dir)``."""

    def __init__(self, work: Path, *extra_args: str, root_of_trust: bool = False, storage: Sequence[str] = ()) -> None:
        """``root_of_trust``: serve a root (one root key; the publisher key, threshold 1; a
        timestamp key) instead of the bare publisher key; ``server.fingerprint`` is its fingerprint.
        ``storage``: `fctkit serve` storage arguments in place of ``--data`` (``--database URL
        --object-store s3://BUCKET/PREFIX``, the scale-out backend); empty: a data directory."""
        from fctkit.export.keys import save_public_key

        self.work = Path(work)
        self.work.mkdir(parents=True, exist_ok=True)
        self.key = Ed25519PrivateKey.generate()
        publisher_pub = save_public_key(self.key.public_key(), self.work / "publisher.pub")
        self.fingerprint = ""
        if root_of_trust:
            extra_args = (*self._root_args(publisher_pub), *extra_args)
        super().__init__(self.work / "server-data", None if root_of_trust else publisher_pub, extra_args, storage)

    def _root_args(self, publisher_pub: Path) -> tuple[str, ...]:
        from fctkit.export.keys import generate_keys, init_root, load_public_key
        from fctkit.protos.trust import root_fingerprint

        timestamp_key, timestamp_pub = generate_keys(self.work / "timestamp")
        root_file, signed, _ = init_root(
            self.work / "root",
            root_keys=1,
            root_threshold=1,
            publisher_keys=[load_public_key(publisher_pub)],
            timestamp_keys=[load_public_key(timestamp_pub)],
        )
        self.fingerprint = root_fingerprint(signed)
        return ("--root", str(root_file), "--timestamp-key", str(timestamp_key))

    def __enter__(self) -> LoopbackServer:
        return self.start(timeout_s=60)

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
