"""Throwaway services for the server's scale-out backend tests, both on loopback.

* ``start_postgres(root)``: a fresh PostgreSQL cluster (initdb + pg_ctl, trust auth, superuser
  ``fctkit``, fsync off) on a free TCP port of 127.0.0.1; ``create_database`` gives each test a
  database of its own. PostgreSQL refuses to run as root, so as root initdb and pg_ctl run as the
  ``postgres`` user (``runuser``), in a directory of the system temp dir that user can reach.
* ``start_s3(log_path)``: moto's server (``moto_server``) on a free port of 127.0.0.1, a real
  S3-compatible HTTP endpoint; ``s3_environment(url)`` is what a server process needs to use it.

Both raise ``ServiceUnavailable(reason)`` when the service cannot start (binaries or packages
missing, no ``postgres`` user while root, a failed start, with the tail of the service's log);
tests/conftest.py turns that into a skip, or a failure under CI=true.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
import pwd
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

PG_USER = "fctkit"
PG_SETTINGS = "-c listen_addresses=127.0.0.1 -c max_connections=400 -c fsync=off -c shared_buffers=64MB"
S3_ENV: dict[str, str] = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
S3_START_TIMEOUT_S = 20.0
_DATABASE_NAME = re.compile(r"[a-z0-9_]+")
_SOCKET_PATH_MAX = 100  # sun_path holds 108 bytes; the socket is <socket_dir>/.s.PGSQL.<port>


class ServiceUnavailable(Exception):
    """A test service could not start; the message says why."""


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago (the OS's pick for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _tail(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"(no log at {path}: {exc.strerror})"
    return "\n".join(text.splitlines()[-lines:]) or f"(empty log at {path})"


# --- PostgreSQL -------------------------------------------------------------------------------


def find_postgres_bin() -> Path | None:
    """The folder holding initdb and pg_ctl: PATH first, then the highest /usr/lib/postgresql/<N>/bin
    (where Debian's postgresql package puts them, off PATH)."""
    initdb, pg_ctl = shutil.which("initdb"), shutil.which("pg_ctl")
    if initdb and pg_ctl and Path(initdb).parent == Path(pg_ctl).parent:
        return Path(initdb).parent

    def version(folder: str) -> tuple[int, ...]:
        name = Path(folder).parent.name
        return tuple(int(part) for part in name.split(".")) if re.fullmatch(r"\d+(\.\d+)*", name) else (-1,)

    for folder in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=version, reverse=True):
        if os.access(Path(folder, "initdb"), os.X_OK) and os.access(Path(folder, "pg_ctl"), os.X_OK):
            return Path(folder)
    return None


@dataclass
class PostgresCluster:
    port: int
    socket_dir: Path
    data_dir: Path
    user: str  # the database superuser, "fctkit" (trust auth: no password)
    log_path: Path | None = None
    _bin: Path | None = field(default=None, repr=False)
    _as_postgres: bool = field(default=False, repr=False)
    _base: Path | None = field(default=None, repr=False)  # removed by stop() when start_postgres made it
    _stopped: bool = field(default=False, repr=False)

    def dsn(self, database: str = "postgres") -> str:
        """A libpq URI for ``database`` over TCP on 127.0.0.1."""
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        """CREATE DATABASE ``name`` ([a-z0-9_]+); its dsn."""
        if not _DATABASE_NAME.fullmatch(name):
            raise ValueError(f"database name must match [a-z0-9_]+, got {name!r}")
        import psycopg
        from psycopg import sql

        with psycopg.connect(self.dsn(), autocommit=True, connect_timeout=10) as connection:
            connection.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.dsn(name)

    def stop(self) -> None:
        """Stop the cluster at once (pg_ctl stop -m immediate) and remove its files. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        pg_ctl = str(self._bin / "pg_ctl") if self._bin else "pg_ctl"
        command = [pg_ctl, "-D", str(self.data_dir), "-m", "immediate", "-w", "stop"]
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            subprocess.run(
                _as_user(command, self._as_postgres),
                cwd=self.socket_dir.parent,
                capture_output=True,
                timeout=60,
                check=False,
            )
        shutil.rmtree(self._base if self._base is not None else self.data_dir, ignore_errors=True)


def _as_user(command: list[str], as_postgres: bool) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *command] if as_postgres else command


def start_postgres(root: Path) -> PostgresCluster:
    """A fresh cluster on a free port of 127.0.0.1, superuser ``fctkit`` with trust auth.

    Its files live under ``root``, except as root (PostgreSQL then runs as the ``postgres`` user,
    which cannot traverse pytest's 0700 temp dirs) or when ``root`` is too long a path for the
    unix socket: then under a ``fctkit-pg-*`` dir of the system temp dir, which ``stop`` removes.
    Raises ServiceUnavailable with the reason (and the tail of the pg log) when it cannot start.
    """
    bin_dir = find_postgres_bin()
    if bin_dir is None:
        raise ServiceUnavailable(
            "PostgreSQL is not installed: no initdb/pg_ctl on PATH or under /usr/lib/postgresql/*/bin "
            "(make test installs it: apt-get install postgresql)"
        )
    as_postgres = os.geteuid() == 0
    if as_postgres:
        try:
            postgres = pwd.getpwnam("postgres")
        except KeyError:
            raise ServiceUnavailable(
                "running as root, and PostgreSQL refuses to run as root, but there is no 'postgres' "
                "user to run it as (Debian's postgresql package creates one)"
            ) from None
        if shutil.which("runuser") is None:
            raise ServiceUnavailable(
                "running as root, but runuser (util-linux) is missing to run PostgreSQL as 'postgres'"
            )

    root = Path(root)
    created_base = as_postgres or len(str(root / "socket" / ".s.PGSQL.65535")) > _SOCKET_PATH_MAX
    if created_base:
        base = Path(tempfile.mkdtemp(prefix="fctkit-pg-"))
        os.chmod(base, 0o755)
    else:
        base = root
        base.mkdir(parents=True, exist_ok=True)
    data_dir, socket_dir, log_path = base / "data", base / "socket", base / "postgres.log"
    socket_dir.mkdir(mode=0o700)
    if as_postgres:
        os.chown(socket_dir, postgres.pw_uid, postgres.pw_gid)
        os.chown(base, postgres.pw_uid, postgres.pw_gid)  # initdb creates data/, pg_ctl writes the log

    def give_up(reason: str) -> ServiceUnavailable:
        if created_base:
            shutil.rmtree(base, ignore_errors=True)
        return ServiceUnavailable(reason)

    initdb = _as_user(
        [str(bin_dir / "initdb"), "-D", str(data_dir), "-A", "trust", "-U", PG_USER, "--no-locale", "-E", "UTF8"],
        as_postgres,
    )
    try:
        done = subprocess.run(initdb, cwd=base, capture_output=True, text=True, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise give_up(f"initdb could not run: {exc}") from None
    if done.returncode != 0:
        output = "\n".join((done.stdout + done.stderr).splitlines()[-20:])
        raise give_up(f"initdb failed (exit {done.returncode}):\n{output}")

    # The port is free when picked, but another process may take it before postgres binds it.
    for attempt in range(3):
        port = free_port()
        options = f"-k {shlex.quote(str(socket_dir))} -p {port} {PG_SETTINGS}"
        start = _as_user(
            [
                str(bin_dir / "pg_ctl"),
                "-D",
                str(data_dir),
                "-l",
                str(log_path),
                "-o",
                options,
                "-w",
                "-t",
                "60",
                "start",
            ],
            as_postgres,
        )
        try:
            done = subprocess.run(start, cwd=base, capture_output=True, text=True, timeout=90, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise give_up(f"pg_ctl start could not run: {exc}\n{_tail(log_path)}") from None
        if done.returncode == 0:
            return PostgresCluster(
                port=port,
                socket_dir=socket_dir,
                data_dir=data_dir,
                user=PG_USER,
                log_path=log_path,
                _bin=bin_dir,
                _as_postgres=as_postgres,
                _base=base if created_base else None,
            )
        log = _tail(log_path)
        if "could not bind" not in log or attempt == 2:
            raise give_up(
                f"pg_ctl start failed (exit {done.returncode}): {done.stderr.strip()}\ntail of the server log:\n{log}"
            )
    raise AssertionError("unreachable")


# --- S3 (moto) --------------------------------------------------------------------------------


def s3_environment(url: str) -> dict[str, str]:
    """The AWS environment variables a server process needs to use the endpoint at ``url``."""
    return {"AWS_ENDPOINT_URL": url, **S3_ENV}


@dataclass
class S3Endpoint:
    url: str  # http://127.0.0.1:PORT
    process: subprocess.Popen

    def client(self):
        """A boto3 S3 client of this endpoint, with the dummy credentials."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.url,
            aws_access_key_id=S3_ENV["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=S3_ENV["AWS_SECRET_ACCESS_KEY"],
            region_name=S3_ENV["AWS_DEFAULT_REGION"],
        )

    def create_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)

    def stop(self) -> None:
        """Terminate moto's server (kill it after 10 s). Idempotent."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _moto_command(port: int) -> list[str]:
    script = Path(sys.executable).parent / "moto_server"
    head = [str(script)] if os.access(script, os.X_OK) else [sys.executable, "-m", "moto.server"]
    return [*head, "-H", "127.0.0.1", "-p", str(port)]


def start_s3(log_path: Path) -> S3Endpoint:
    """moto's server on a free port of 127.0.0.1 (its output in ``log_path``), once it answers HTTP.
    Raises ServiceUnavailable with the reason when moto[server] is missing or it does not come up."""
    missing = [
        name for name in ("moto", "flask", "flask_cors", "werkzeug", "boto3") if importlib.util.find_spec(name) is None
    ]
    if missing:
        raise ServiceUnavailable(
            f"moto[server] is not installed: no module {', '.join(missing)} (pip install 'moto[server]')"
        )
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    # No proxy for loopback, whatever the environment says.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    for attempt in range(3):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        with open(log_path, "ab") as log:
            process = subprocess.Popen(
                _moto_command(port), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        endpoint = S3Endpoint(url=url, process=process)
        deadline = time.monotonic() + S3_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if process.poll() is not None:
                break
            try:
                opener.open(url, timeout=1).close()
                return endpoint
            except urllib.error.HTTPError:
                return endpoint  # an HTTP answer, even an error, means it serves
            except OSError:
                time.sleep(0.1)
        exited = process.poll() is not None
        endpoint.stop()
        log = _tail(log_path)
        if exited and "Address already in use" in log and attempt < 2:
            continue
        if exited:
            raise ServiceUnavailable(f"moto_server exited with {process.returncode}; tail of {log_path}:\n{log}")
        raise ServiceUnavailable(
            f"moto_server did not answer at {url} within {S3_START_TIMEOUT_S:.0f} s; tail of the server log:\n{log}"
        )
    raise AssertionError("unreachable")
