"""Persistence across a restart, graceful shutdown, start-up checks and TLS, each against real
`fctkit serve` processes."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import pytest
from click.testing import CliRunner

from fctkit.cli import cli
from fctkit.errors import ConfigError, RpcStatusError
from fctkit.protos import fleet_pb2
from fctkit.protos.bundle import MANIFEST_FILE
from fctkit.protos.client import ClientTls, FctkitClient, RetryPolicy

from .conftest import ADMIN_TOKEN, ServerProcess, make_certificates, status_code

_RETRIES: list[float] = []


@dataclass(frozen=True)
class CountingRetryPolicy(RetryPolicy):
    """Records every backoff the client takes, so the test can see that retries happened."""

    def delays(self):
        for delay in super().delays():
            _RETRIES.append(delay)
            yield delay


def test_everything_survives_a_restart_and_clients_retry_through_it(
    tmp_path, publisher_pub, admin_token_file, archives, bundles
):
    server = ServerProcess(tmp_path / "data", publisher_pub, admin_token_file).start()
    patient = CountingRetryPolicy(attempts=60, initial_backoff_s=0.05, max_backoff_s=0.5)
    admin = FctkitClient(server.target, ADMIN_TOKEN, retry=patient)
    for version in (1, 2):
        admin.publish_bundle(archives[version])
    enrolment = FctkitClient(server.target).enrol(admin.create_enrolment_code().code, "camera")
    device = FctkitClient(server.target, enrolment.token, retry=patient)
    spare_code = admin.create_enrolment_code().code
    blob = b"\x17encrypted" * 50_000
    sha256 = device.upload_blob(blob, item_id="photo-1").sha256
    device.report(2, 42, fleet_pb2.UPGRADE_STATE_IDLE, detail="ready")
    before = (admin.list_versions(), admin.list_devices(), device.list_blobs())

    assert server.stop() == 0  # graceful: SIGTERM, exit code 0
    assert server.events()[-1]["event"] == "stopped"
    orphan = server.data_dir / "artifacts" / "ab" / ("ab" * 32)
    orphan.parent.mkdir(exist_ok=True)
    orphan.write_bytes(b"left by a crash between file and row")
    (server.data_dir / "tmp" / "publish-crashed").mkdir()

    _RETRIES.clear()
    restarted = ServerProcess(server.data_dir, publisher_pub, admin_token_file)
    restarted.port = server.port
    starting = threading.Thread(target=restarted.start)
    starting.start()
    sent = time.monotonic()
    versions = device.list_versions()  # sent while the new process is still starting (it takes > 1 s)
    waited = time.monotonic() - sent
    starting.join()
    # retried until the server was back: by gRPC's retry policy (unary calls) or the kit's backoff
    assert _RETRIES or waited > 0.3, "the call should have waited for the server instead of failing"
    try:
        assert versions == before[0]
        assert admin.list_devices() == before[1] and device.list_blobs() == before[2]
        assert device.read_blob(sha256) == blob
        assert device.get_manifest(2)[0] == (bundles[2] / MANIFEST_FILE).read_bytes()
        assert FctkitClient(restarted.target).enrol(spare_code, "late").device_id  # unused codes persist
        removed = next(e for e in restarted.events() if e.get("event") == "storage opened")["garbage_removed"]
        assert removed == {"artifacts": 1, "blobs": 0, "staging": 1} and not orphan.exists()
    finally:
        restarted.stop()


def test_admin_publish_and_shutdown_ending_watch_streams_cleanly(start_server, admin_token_file, bundles):
    server = start_server()
    admin = FctkitClient(server.target, ADMIN_TOKEN, retry=RetryPolicy(attempts=1))
    published = CliRunner().invoke(
        cli,
        ["admin", "--server", server.target, "--admin-token-file", str(admin_token_file), "publish", str(bundles[1])],
    )  # a bundle directory: the command packs it
    assert published.exit_code == 0 and "published version 1" in published.output, published.output
    seen, outcome = [], []

    def watch():
        try:
            seen.extend(v.version for v in admin.watch_versions())
            outcome.append("ended")
        except RpcStatusError as exc:
            outcome.append(exc.code)

    watcher = threading.Thread(target=watch)
    watcher.start()
    watcher.join(1.0)
    assert watcher.is_alive() and seen == [1]
    assert server.stop() == 0
    watcher.join(30)
    assert outcome == ["ended"]
    assert [e["code"] for e in server.events() if e.get("method") == "/fctkit.v1.Registry/WatchVersions"] == ["OK"]


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fctkit.cli", "serve", *args], capture_output=True, text=True, timeout=120
    )


def test_bad_start_up_settings_fail_with_one_clear_line(tmp_path, publisher_pub, admin_token_file, archives):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from fctkit.export.keys import save_public_key

    base = ["--data", str(tmp_path / "data"), "--port", "0", "--admin-token-file", str(admin_token_file)]
    result = _serve(*base, "--publisher-key", str(publisher_pub), "--tls-cert", str(publisher_pub))
    assert result.returncode == 2 and "TLS needs both" in result.stderr and "Traceback" not in result.stderr
    server = ServerProcess(tmp_path / "data", publisher_pub, admin_token_file).start()
    FctkitClient(server.target, ADMIN_TOKEN).publish_bundle(archives[1])
    result = _serve(*base, "--publisher-key", str(publisher_pub))
    assert result.returncode == 2 and "in use by another fctkit server" in result.stderr
    server.stop()
    stranger = save_public_key(Ed25519PrivateKey.generate().public_key(), tmp_path / "stranger.pub")
    result = _serve(*base, "--publisher-key", str(stranger))
    assert result.returncode == 2 and "does not verify under the given publisher key" in result.stderr
    assert "Traceback" not in result.stderr
    short = tmp_path / "short.token"
    short.write_text("too-short")
    result = _serve(
        "--data",
        str(tmp_path / "data"),
        "--port",
        "0",
        "--publisher-key",
        str(publisher_pub),
        "--admin-token-file",
        str(short),
    )
    assert result.returncode == 2 and "at least 32" in result.stderr


def test_tls_serves_verified_clients_and_refuses_plaintext(start_server, tmp_path, archives):
    pki = make_certificates(tmp_path / "pki")
    server = start_server("--tls-cert", str(pki["server"]), "--tls-key", str(pki["server_key"]))
    assert next(e for e in server.events() if e.get("event") == "listening")["tls"] is True
    with FctkitClient(server.target, ADMIN_TOKEN, tls=ClientTls(pki["ca"].read_bytes())) as admin:
        version = admin.publish_bundle(archives[1])
        assert [v.version for v in admin.list_versions()] == [version.version] == [1]
        side_info = next(a for a in version.artifacts if a.name == "side_info")
        with open("/dev/null", "wb") as sink:
            assert admin.fetch_artifact(1, "side_info", sink).sha256 == side_info.sha256  # checked while streaming
    with (
        FctkitClient(server.target, ADMIN_TOKEN, retry=RetryPolicy(attempts=1)) as plaintext,
        pytest.raises(RpcStatusError) as refused,
    ):
        plaintext.list_versions()
    assert refused.value.code == "UNAVAILABLE"


def test_mutual_tls_admits_only_clients_with_a_certificate_from_the_client_ca(
    start_server, tmp_path, archives, admin_token_file, publisher_pub
):
    pki = make_certificates(tmp_path / "pki")
    server = start_server(
        "--tls-cert", str(pki["server"]), "--tls-key", str(pki["server_key"]), "--tls-ca", str(pki["ca"])
    )
    listening = next(e for e in server.events() if e.get("event") == "listening")
    assert listening["tls"] is True and listening["client_certificates"] is True
    ca = pki["ca"].read_bytes()
    identity = ClientTls(ca, pki["client"].read_bytes(), pki["client_key"].read_bytes())
    with FctkitClient(server.target, ADMIN_TOKEN, tls=identity) as admin:
        assert admin.publish_bundle(archives[1]).version == 1
    once = RetryPolicy(attempts=1)
    stranger = ClientTls(ca, pki["stranger"].read_bytes(), pki["stranger_key"].read_bytes())
    for tls in (ClientTls(ca), stranger):  # no certificate, or one the client CA did not sign
        with FctkitClient(server.target, ADMIN_TOKEN, tls=tls, retry=once) as refused:
            assert status_code(refused.list_versions) == "UNAVAILABLE"
    admin_cli = [
        "admin",
        "--server",
        server.target,
        "--admin-token-file",
        str(admin_token_file),
        "--tls-ca",
        str(pki["ca"]),
    ]
    listed = CliRunner().invoke(
        cli,
        [*admin_cli, "--tls-cert", str(pki["client"]), "--tls-key", str(pki["client_key"]), "list-versions", "--json"],
    )
    assert listed.exit_code == 0 and [v["version"] for v in json.loads(listed.output)] == [1], listed.output
    half = CliRunner().invoke(cli, [*admin_cli, "--tls-cert", str(pki["client"]), "list-versions"])
    assert isinstance(half.exception, ConfigError) and "--tls-cert with --tls-key" in str(half.exception)
    result = _serve(
        "--data",
        str(tmp_path / "other"),
        "--port",
        "0",
        "--publisher-key",
        str(publisher_pub),
        "--tls-ca",
        str(pki["ca"]),
    )
    assert result.returncode == 2 and "--tls-ca (require client certificates) needs TLS" in result.stderr
