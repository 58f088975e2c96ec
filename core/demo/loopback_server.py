"""The demo's server: `fctkit serve` in a subprocess of its own process group on a free
loopback port, stopped with its whole group so that nothing is left running."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from fctkit.errors import FctkitError

if TYPE_CHECKING:
    from fctkit.protos.client import FctkitClient


class DemoServer:
    """`fctkit serve` in its own process group on a free loopback port, trusting ``publisher_pub``
    (a publisher.pub) or a root: pass ``("--root", ROOT, "--timestamp-key", KEY)`` in ``extra_args``
    (appended to its command line, like ``("--replica-quota-bytes", "1099511627776")``)."""

    def __init__(
        self, data_dir: Path, publisher_pub: Path | None, extra_args: Sequence[str] = (), storage: Sequence[str] = ()
    ) -> None:
        """``storage``: `fctkit serve` storage arguments in place of ``--data DATA_DIR`` (e.g.
        ``--database URL --object-store s3://BUCKET/PREFIX``); ``data_dir``'s folder still holds
        the token and the log."""
        self.data_dir = data_dir
        self.extra_args = tuple(extra_args)
        self.storage = tuple(storage) or ("--data", str(data_dir))
        self.token_file = data_dir.parent / "admin.token"
        self.log_path = data_dir.parent / "server.log"
        self.publisher_pub = publisher_pub
        self.process: subprocess.Popen | None = None
        self.port = 0

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def admin_token(self) -> str:
        return self.token_file.read_text().strip()

    def start(self, timeout_s: float = 120.0) -> DemoServer:
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_urlsafe(32) + "\n")
        command = [
            sys.executable,
            "-m",
            "fctkit.cli",
            "serve",
            *self.storage,
            "--port",
            "0",
            *(("--publisher-key", str(self.publisher_pub)) if self.publisher_pub else ()),
            "--admin-token-file",
            str(self.token_file),
            "--shutdown-grace",
            "2",
            *self.extra_args,
        ]
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(
                command,
                stdout=subprocess.DEVNULL,
                stderr=log,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in self.log_path.read_text(errors="replace").splitlines():
                if line.startswith("{") and '"listening"' in line:
                    event = json.loads(line)
                    if event.get("event") == "listening":
                        self.port = int(event["port"])
                        return self
            if self.process.poll() is not None:
                raise FctkitError(f"the server exited with {self.process.returncode}; see {self.log_path}")
            time.sleep(0.05)
        raise FctkitError(f"the server did not start within {timeout_s:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        """SIGTERM the server's process group, SIGKILL it if it lingers."""
        if self.process is None or self.process.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.process.wait(wait_s)
                return
            except subprocess.TimeoutExpired:
                continue

    def admin(self) -> FctkitClient:
        from fctkit.protos.client import FctkitClient

        return FctkitClient(self.target, self.admin_token)


__all__ = ["DemoServer"]
