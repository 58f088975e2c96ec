"""Fixtures for the server tests: real `fctkit serve` processes on loopback, a publisher key,
and real signed bundles (v1..v5) built from tiny ONNX graphs (onnx.helper, no torch).

Every test that starts a server through ``start_server`` (or opens storage through
``open_storage``) runs once per storage backend (:data:`BACKENDS`): ``sqlite`` (``--data DIR``)
and ``postgres`` (a throwaway PostgreSQL cluster plus moto's S3 server, both started once per
test session; each data directory name maps to a database and a bucket prefix of its own).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fctkit.errors import RpcStatusError
from fctkit.export.bundle_builder import ArtifactSource, build_bundle
from fctkit.export.keys import save_public_key
from fctkit.protos.bundle import pack_bundle
from fctkit.protos.client import Enrolment, FctkitClient

EMBED_DIM, SIDE_DIM, IMAGE_DIM = 8, 4, 16
BIG_IMAGE_DIM = 80_000  # v1's embed graph: 80,000 x 8 float32 weights, about 2.5 MB
ADMIN_TOKEN = "fcta_test-admin-token-0123456789abcdef0123456789"


def status_code(call: Callable[[], object]) -> str:
    """The gRPC status code (name) of ``call``, which must fail with the kit's RpcStatusError."""
    with pytest.raises(RpcStatusError) as caught:
        call()
    return caught.value.code


def call_status(call: Callable[[], object]) -> str:
    """``OK`` when ``call`` succeeds, else the gRPC status code (name) of the kit's RpcStatusError it raised."""
    try:
        call()
    except RpcStatusError as error:
        return error.code
    return "OK"


def enrolled_client(server, owner: str = "", name: str = "device", **options) -> tuple[FctkitClient, Enrolment]:
    """Enrol a device named ``name`` into ``owner`` (empty: a new owner of its own) with a fresh
    admin code; a client holding its token (``options`` for FctkitClient) and the enrolment."""
    with FctkitClient(server.target, ADMIN_TOKEN) as admin:
        code = admin.create_enrolment_code(label=f"for {name}", owner=owner).code
    with FctkitClient(server.target) as anonymous:
        enrolment = anonymous.enrol(code, name)
    return FctkitClient(server.target, enrolment.token, **options), enrolment


def make_certificates(folder: Path) -> dict[str, Path]:
    """A test PKI in ``folder``: ``ca`` (a CA certificate), ``server``/``server_key`` (for
    localhost and 127.0.0.1), ``client``/``client_key`` (both signed by ``ca``), and
    ``stranger``/``stranger_key`` (a client certificate from another, self-signed CA)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def issue(name: str, issuer: tuple | None, *, ca: bool = False, names: list | None = None):
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        issuer_name, issuer_key = issuer if issuer else (subject, key)
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        certificate = builder.sign(issuer_key, hashes.SHA256())
        cert_path, key_path = folder / f"{name}.crt", folder / f"{name}.key"
        cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        return (subject, key), cert_path, key_path

    folder.mkdir(parents=True, exist_ok=True)
    ca, ca_cert, _ = issue("ca", None, ca=True)
    local = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    _, server, server_key = issue("server", ca, names=local)
    _, client, client_key = issue("client", ca)
    _, stranger, stranger_key = issue("stranger", None)
    return {
        "ca": ca_cert,
        "server": server,
        "server_key": server_key,
        "client": client,
        "client_key": client_key,
        "stranger": stranger,
        "stranger_key": stranger_key,
    }


def linear_onnx(path: Path, inputs: dict[str, int], out_dim: int, *, seed: int, output: str) -> Path:
    """A real ONNX graph: concatenate the inputs, multiply by a seeded matrix."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((sum(inputs.values()), out_dim)).astype(np.float32)
    nodes, joined = [], next(iter(inputs))
    if len(inputs) > 1:
        nodes.append(helper.make_node("Concat", list(inputs), ["joined"], axis=1))
        joined = "joined"
    nodes.append(helper.make_node("MatMul", [joined, "W"], [output]))
    graph = helper.make_graph(
        nodes,
        "tiny",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", d]) for n, d in inputs.items()],
        [helper.make_tensor_value_info(output, TensorProto.FLOAT, ["batch", out_dim])],
        initializer=[numpy_helper.from_array(weight, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def _sources(folder: Path, version: int, hops: tuple[tuple[int, int], ...], image_dim: int) -> list[ArtifactSource]:
    folder.mkdir(parents=True, exist_ok=True)
    seed = version * 100
    sources = [
        ArtifactSource(
            linear_onnx(folder / "embed.onnx", {"image": image_dim}, EMBED_DIM, seed=seed, output="embedding"), "embed"
        ),
        ArtifactSource(
            linear_onnx(folder / "side.onnx", {"image": IMAGE_DIM}, SIDE_DIM, seed=seed + 1, output="side_info"),
            "side_info",
        ),
    ]
    for i, (source, target) in enumerate(hops):
        old = {"old_embedding": EMBED_DIM, "old_side_info": SIDE_DIM}
        h = linear_onnx(folder / f"h{source}.onnx", old, EMBED_DIM, seed=seed + 10 + i, output="new_embedding")
        g = linear_onnx(folder / f"g{source}.onnx", old, SIDE_DIM, seed=seed + 20 + i, output="new_side_info")
        sources += [ArtifactSource(h, "forward", source, target), ArtifactSource(g, "side_forward", source, target)]
    return sources


#: version -> the adapters its bundle carries; v4 has a direct 1->4 adapter besides 3->4.
CHAIN: dict[int, tuple[tuple[int, int], ...]] = {1: (), 2: ((1, 2),), 3: ((2, 3),), 4: ((3, 4), (1, 4)), 5: ((4, 5),)}


@pytest.fixture(scope="session")
def publisher_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(bytes(range(100, 132)))


@pytest.fixture(scope="session")
def publisher_pub(tmp_path_factory, publisher_key) -> Path:
    return save_public_key(publisher_key.public_key(), tmp_path_factory.mktemp("keys") / "publisher.pub")


@pytest.fixture(scope="session")
def admin_token_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("admin") / "admin.token"
    path.write_text(ADMIN_TOKEN + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture(scope="session")
def bundles(tmp_path_factory, publisher_key) -> dict[int, Path]:
    """Signed bundle directories v1..v5 of the CHAIN (v1's embed graph is ~2.5 MB)."""
    root = tmp_path_factory.mktemp("bundles")
    return {
        version: chain_bundle(root, version, publisher_key, BIG_IMAGE_DIM if version == 1 else IMAGE_DIM)
        for version in CHAIN
    }


def chain_bundle(
    folder: Path,
    version: int,
    key: Ed25519PrivateKey,
    image_dim: int = IMAGE_DIM,
    *,
    cases: dict | None = None,
    force_reason: str | None = None,
    health_expectation=None,
) -> Path:
    """Bundle ``version`` of the CHAIN, signed by ``key``, as the folder ``folder/v<version>``;
    with ``force_reason`` its gate failed ECC and was overridden at export with that reason;
    ``health_expectation``: what its manifest expects devices to report."""
    sources = _sources(folder / f"src{version}", version, CHAIN[version], image_dim)
    ecc = {s.artifact_name: force_reason is None for s in sources if s.role == "forward"}
    return build_bundle(
        folder / f"v{version}",
        version=version,
        parents=(version - 1,) if version > 1 else (),
        mode="forward",
        distance="cosine",
        normalize=True,
        artifacts=sources,
        gate={"cases": cases or {}, "ecc": ecc},
        private_key=key,
        force=force_reason is not None,
        force_reason=force_reason,
        health_expectation=health_expectation,
    ).root


@pytest.fixture(scope="session")
def archives(tmp_path_factory, bundles) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("archives")
    return {v: pack_bundle(path, root / f"v{v}.tar") for v, path in bundles.items()}


BACKENDS = ("sqlite", "postgres")
BUCKET = "fctkit-tests"


class Backend:
    """One storage backend for servers and in-process storage: ``sqlite`` keeps everything in
    the data directory; ``postgres`` maps the data directory's path to a database and a bucket
    prefix of its own (so a restarted server finds its state again)."""

    def __init__(self, name: str, cluster=None, s3=None) -> None:
        self.name, self.cluster, self.s3 = name, cluster, s3

    def _names(self, data_dir: Path) -> tuple[str, str]:
        import hashlib

        key = "t_" + hashlib.sha256(str(Path(data_dir).resolve()).encode()).hexdigest()[:20]
        if key not in _CREATED:
            self.cluster.create_database(key)
            _CREATED.add(key)
        return self.cluster.dsn(key), f"s3://{BUCKET}/{key}"

    def server_args(self, data_dir: Path) -> list[str]:
        if self.name == "sqlite":
            return ["--data", str(data_dir)]
        database, object_store = self._names(data_dir)
        Path(data_dir).mkdir(parents=True, exist_ok=True)  # the log goes next to it either way
        return ["--database", database, "--object-store", object_store]

    def environment(self) -> dict[str, str]:
        from tests.support.scale_services import s3_environment

        return s3_environment(self.s3.url) if self.s3 else {}

    def open_storage(self, data_dir: Path):
        if self.name == "sqlite":
            from fctkit.server.storage import SqliteStorage

            return SqliteStorage(data_dir)
        from fctkit.server.scale_out import ScaleOutStorage

        database, object_store = self._names(data_dir)
        return ScaleOutStorage(database, object_store, s3_endpoint_url=self.s3.url)

    def objects(self, data_dir: Path, kind: str) -> dict[str, bytes]:
        """Every stored object of ``kind`` ("artifacts" or "blobs") by name, read from where this backend keeps them."""
        if self.name == "sqlite":
            return {p.name: p.read_bytes() for p in sorted((Path(data_dir) / kind).rglob("*")) if p.is_file()}
        prefix = f"{self._names(data_dir)[1].removeprefix(f's3://{BUCKET}/')}/{kind}/"
        client = self.s3.client()
        keys = [
            o["Key"]
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
            for o in page.get("Contents", ())
        ]
        return {
            key.removeprefix(prefix): client.get_object(Bucket=BUCKET, Key=key)["Body"].read() for key in sorted(keys)
        }

    def query(self, data_dir: Path, sql: str) -> list[tuple]:
        """Rows of ``sql`` on the server's metadata database (read only)."""
        if self.name == "sqlite":
            import sqlite3

            with sqlite3.connect(f"file:{Path(data_dir) / 'meta.sqlite3'}?mode=ro", uri=True) as db:
                return [tuple(bytes(v) if isinstance(v, memoryview) else v for v in row) for row in db.execute(sql)]
        import psycopg

        with psycopg.connect(self._names(data_dir)[0]) as connection:
            return [tuple(row) for row in connection.execute(sql)]

    def alter(self, data_dir: Path, *statements: str) -> None:
        """Run ``statements`` on the server's metadata database (to make it look like an older schema's)."""
        if self.name == "sqlite":
            import sqlite3

            with sqlite3.connect(Path(data_dir) / "meta.sqlite3") as db:
                for statement in statements:
                    db.execute(statement)
            return
        import psycopg

        with psycopg.connect(self._names(data_dir)[0]) as connection:
            for statement in statements:
                connection.execute(statement)

    def aged(
        self,
        data_dir: Path,
        open_storage: Callable[[Path], object],
        schema: int,
        *statements: str,
        versions: tuple[int, ...] = (),
    ) -> object:
        """A storage in ``data_dir`` with ``versions`` published, made to look like schema ``schema``'s
        (``statements`` drop what later schemas added, then the schema number is set back) and
        opened again: migrated, as a server upgrading it would find it."""
        from fctkit.server.storage import VersionRecord

        storage = open_storage(data_dir)
        for version in versions:
            storage.add_version(VersionRecord(version, b"{}", b"sig", "now"), [])
        storage.close()
        marker = (
            [f"PRAGMA user_version={schema}"]
            if self.name == "sqlite"
            else ["DELETE FROM fctkit_schema", f"INSERT INTO fctkit_schema VALUES ({schema})"]
        )
        self.alter(data_dir, *statements, *marker)
        return open_storage(data_dir)

    def metadata_dump(self, data_dir: Path) -> bytes:
        """Everything the metadata store holds, as bytes (to check that no secret is stored)."""
        if self.name == "sqlite":
            return b"".join(p.read_bytes() for p in Path(data_dir).glob("meta.sqlite3*"))
        tables = [t for (t,) in self.query(data_dir, "SELECT tablename FROM pg_tables WHERE schemaname='public'")]
        return repr([self.query(data_dir, f"SELECT * FROM {t}") for t in tables]).encode()


_CREATED: set[str] = set()


def pytest_collection_modifyitems(config, items):
    """Tests marked ``sqlite_only`` (about the data directory itself, or a protocol limit that no
    backend changes and that is slow to repeat) run on ``sqlite`` only."""
    deselected = [
        item
        for item in items
        if item.get_closest_marker("sqlite_only")
        and getattr(item, "callspec", None)
        and item.callspec.params.get("backend") == "postgres"
    ]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if item not in deselected]


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request) -> Backend:
    """The storage backend this module's servers use (each module runs once per backend)."""
    return Backend("sqlite") if request.param == "sqlite" else postgres_backend(request)


def postgres_backend(request) -> Backend:
    """The scale-out backend over the session's PostgreSQL cluster and S3 endpoint."""
    cluster, s3 = request.getfixturevalue("postgres_cluster"), request.getfixturevalue("s3_endpoint")
    if BUCKET not in {b["Name"] for b in s3.client().list_buckets().get("Buckets", [])}:
        s3.create_bucket(BUCKET)
    from tests.support.scale_services import s3_environment

    os.environ.update(s3_environment(s3.url))  # for storage opened in this process (boto3 reads them)
    return Backend("postgres", cluster, s3)


@pytest.fixture(scope="module")
def scale_out(request) -> Backend:
    """The postgres backend alone, for tests of several replicas."""
    return postgres_backend(request)


@pytest.fixture(scope="module")
def start_replicas(tmp_path_factory, publisher_pub, admin_token_file, scale_out) -> Callable[..., list[ServerProcess]]:
    """``start_replicas(n, *extra_args, data_dir=None)``: ``n`` replicas over one database and
    bucket prefix, started at once; stopped at module end."""
    started: list[ServerProcess] = []

    def start(count: int, *args: str, data_dir: Path | None = None) -> list[ServerProcess]:
        data = data_dir or tmp_path_factory.mktemp("replicas") / "data"
        replicas = [
            ServerProcess(data, publisher_pub, admin_token_file, *args, backend=scale_out, log_name=f"replica{k}")
            for k in range(count)
        ]
        for replica in replicas:
            replica.launch()
        started.extend(replicas)
        return [replica.wait_listening() for replica in replicas]

    yield start
    for server in started:
        if server.alive():
            server.stop()


@pytest.fixture(scope="module")
def open_storage(backend) -> Callable[[Path], object]:
    """``open_storage(data_dir)``: the backend's storage, in this process."""
    return backend.open_storage


class ServerProcess:
    """`python -m fctkit.cli serve` in a subprocess; its JSON-lines log goes to a file."""

    def __init__(
        self,
        data_dir: Path,
        publisher_pub: Path,
        admin_token_file: Path,
        *args: str,
        backend: Backend | None = None,
        log_name: str = "server",
    ) -> None:
        self.backend = backend or Backend("sqlite")
        self.data_dir, self.args = Path(data_dir), list(args)
        self.publisher_pub, self.admin_token_file = publisher_pub, admin_token_file
        self.port = 0
        self.log_offset = 0
        self.process: subprocess.Popen | None = None
        self.log_path = self.data_dir.parent / f"{self.data_dir.name}-{log_name}.log"

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> ServerProcess:
        self.launch()
        return self.wait_listening(timeout_s)

    def launch(self) -> None:
        """Start the process (without waiting for it to listen)."""
        log = self.log_path.open("a")
        self.log_offset = log.tell()
        command = [
            sys.executable,
            "-m",
            "fctkit.cli",
            "serve",
            *self.backend.server_args(self.data_dir),
            "--port",
            str(self.port),
            *([] if "--root" in self.args else ["--publisher-key", str(self.publisher_pub)]),
            "--admin-token-file",
            str(self.admin_token_file),
            *self.args,
        ]
        environment = {**os.environ, **self.backend.environment(), "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, env=environment)
        log.close()

    def listening(self) -> bool:
        """Whether the process started last has logged that it listens (without waiting)."""
        return any(event.get("event") == "listening" for event in self.events())

    def wait_listening(self, timeout_s: float = 60.0) -> ServerProcess:
        offset = self.log_offset
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for event in self.events(offset):
                if event.get("event") == "listening":
                    self.port = event["port"]
                    return self
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log_text(offset)}")
            time.sleep(0.05)
        raise RuntimeError(f"server did not start within {timeout_s} s:\n{self.log_text(offset)}")

    def log_text(self, offset: int) -> str:
        return self.log_path.read_bytes()[offset:].decode("utf-8", "replace") if self.log_path.exists() else ""

    def events(self, offset: int | None = None) -> list[dict]:
        """The JSON log lines of this process (since its start)."""
        offset = self.log_offset if offset is None else offset
        text = self.log_text(offset)
        complete_lines = text.split("\n")[:-1]  # the last piece may still be being written
        return [json.loads(line) for line in complete_lines if line.startswith("{")]

    def stop(self, timeout_s: float = 30.0) -> int:
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout_s)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


@pytest.fixture(scope="module")
def start_server(tmp_path_factory, publisher_pub, admin_token_file, backend) -> Callable[..., ServerProcess]:
    """``start_server(*extra_args, data_dir=None)``: a started server on this module's backend,
    stopped at module end (a second one on the same ``data_dir`` is a replica of the first
    under ``postgres``)."""
    started: list[ServerProcess] = []

    def start(*args: str, data_dir: Path | None = None) -> ServerProcess:
        data = data_dir or tmp_path_factory.mktemp("server") / "data"
        server = ServerProcess(data, publisher_pub, admin_token_file, *args, backend=backend).start()
        started.append(server)
        return server

    yield start
    for server in started:
        if server.alive():
            server.stop()
