"""Shared by the edge benchmarks: a real ``fctkit serve`` subprocess on loopback (its own
data directory, a fresh publisher key) and an admin client for codes and publishing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

ADMIN_TOKEN = "fcta_benchmark-admin-token-0123456789abcdef"


class LoopbackServer:
    """``with LoopbackServer(work) as server:`` — ``server.target``, ``server.key`` (the
    publisher's private key), ``server.publisher_pub``, ``server.code(owner)``, ``server.publish(dir)``."""

    def __init__(self, work: Path, *extra_args: str) -> None:
        from fctkit.export.keys import save_public_key

        self.work = Path(work)
        self.work.mkdir(parents=True, exist_ok=True)
        self.key = Ed25519PrivateKey.generate()
        self.publisher_pub = save_public_key(self.key.public_key(), self.work / "publisher.pub")
        self.token_file = self.work / "admin.token"
        self.token_file.write_text(ADMIN_TOKEN + "\n")
        self.token_file.chmod(0o600)
        self.data_dir = self.work / "server-data"
        self.log_path = self.work / "server.log"
        self.extra_args = extra_args
        self.process: subprocess.Popen | None = None
        self.port = 0

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> LoopbackServer:
        command = [sys.executable, "-m", "fctkit.cli", "serve", "--data", str(self.data_dir), "--port", "0",
                   "--publisher-key", str(self.publisher_pub), "--admin-token-file", str(self.token_file),
                   *self.extra_args]
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for line in self.log_path.read_text().splitlines():
                if line.startswith("{") and json.loads(line).get("event") == "listening":
                    self.port = json.loads(line)["port"]
                    return self
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited: {self.log_path.read_text()}")
            time.sleep(0.05)
        raise RuntimeError("the server did not start within 60 s")

    def __exit__(self, *exc: object) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(30)

    def admin(self):
        from fctkit.protos.client import FctkitClient

        return FctkitClient(self.target, ADMIN_TOKEN)

    def code(self, owner: str = "") -> str:
        with self.admin() as admin:
            return admin.create_enrolment_code(owner=owner).code

    def publish(self, bundle_dir: Path) -> None:
        from fctkit.protos.bundle import pack_bundle

        archive = pack_bundle(bundle_dir, self.work / f"{Path(bundle_dir).name}-{os.getpid()}.tar")
        with self.admin() as admin:
            admin.publish_bundle(archive)
