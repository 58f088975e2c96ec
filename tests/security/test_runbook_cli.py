"""README "Keys and trust", command by command through the CLI (`fctkit keys`, `bundle verify`,
`serve`, `admin`, `device`): the root created offline (2 of 3 root keys, 2 of 3 publishers, a
timestamp key), a device enrolled by fingerprint, a release co-signed and published, a leaked
publisher key removed by a new root, and an existing fleet (devices pinning publisher.pub)
moved to a root. The bundles are the edge tests' tiny ones, signed by the first publisher as
`fctkit export` would."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from fctkit.cli import cli as fctkit_main
from fctkit.errors import FctkitError
from fctkit.export.keys import load_private_key
from fctkit.protos.bundle import pack_bundle
from tests.edge.conftest import TINY_CHAIN, device_cli, make_tiny_bundle
from tests.server.conftest import ADMIN_TOKEN, ServerProcess, admin_token_file  # noqa: F401 (a fixture)

PASSPHRASE = "a long and private passphrase"


def fctkit(*args: str | Path) -> str:
    result = CliRunner().invoke(fctkit_main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def refused(*args: str | Path, match: str) -> None:
    """The command fails with the kit's error (what `fctkit` prints, exiting non-zero)."""
    with pytest.raises(FctkitError, match=match):
        fctkit(*args)


def fingerprint(output: str) -> str:
    return next(line.split()[1] for line in output.splitlines() if line.startswith("fingerprint "))


def release(folder: Path, version: int, publisher_key: Path) -> Path:
    """What `fctkit export` hands over: v<N>.tar signed by one publisher."""
    bundle = make_tiny_bundle(
        folder / f"v{version}", load_private_key(publisher_key, PASSPHRASE.encode()), version, TINY_CHAIN[version]
    )
    return pack_bundle(bundle, folder / f"v{version}.tar")


def device(*args: str | Path) -> dict:
    result = device_cli(*(str(a) for a in args))
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout) if result.stdout.strip().startswith("{") else {}


@pytest.fixture
def work(tmp_path, monkeypatch, admin_token_file):  # noqa: F811 (a pytest fixture, imported from tests/server/conftest.py)
    monkeypatch.setenv("FCTKIT_KEY_PASSPHRASE", PASSPHRASE)
    monkeypatch.setenv("FCTKIT_ADMIN_TOKEN", ADMIN_TOKEN)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_keys_and_trust_runbook(work, admin_token_file):  # noqa: F811 (a pytest fixture, imported from tests/server/conftest.py)
    for name in ("alice", "bob", "carol", "timestamp"):
        fctkit("keys", "generate", "--out", f"keys/{name}")
    created = fctkit(
        "keys",
        "init-root",
        "--out",
        "root/",
        "--root-keys",
        3,
        "--root-threshold",
        2,
        "--publisher-key",
        "keys/alice/publisher.pub",
        "--publisher-key",
        "keys/bob/publisher.pub",
        "--publisher-key",
        "keys/carol/publisher.pub",
        "--publisher-threshold",
        2,
        "--timestamp-key",
        "keys/timestamp/publisher.pub",
        "--freshness-days",
        7,
    )
    server = ServerProcess(
        work / "srv",
        None,
        admin_token_file,
        "--root",
        "root/root.1.json",
        "--timestamp-key",
        "keys/timestamp/publisher.key",
    ).start()
    try:
        admin = ("admin", "--server", server.target)
        code = fctkit(*admin, "enrol-code").splitlines()[0]
        fctkit("device", "init", "--dir", "D")
        device(
            "enrol", "--dir", "D", "--server", server.target, "--code", code, "--root-fingerprint", fingerprint(created)
        )

        v1 = release(work / "export", 1, Path("keys/alice/publisher.key"))
        refused(*admin, "publish", v1, match="1 valid signature.* of the 2 needed")  # one publisher of two
        fctkit("keys", "sign", v1, "--key", "keys/bob/publisher.key")
        assert "signed by 2 publisher key(s)" in fctkit("bundle", "verify", v1, "--root", "root/root.1.json")
        fctkit(*admin, "publish", v1)
        assert device("sync", "--dir", "D", "--quiet")["installed_after"] == 1

        fctkit(
            "keys",
            "remove-publisher",
            "root/root.1.json",
            "--key",
            "keys/alice/publisher.pub",
            "--sign-with",
            "root/root-1.key",
            "--sign-with",
            "root/root-2.key",
        )
        assert "root v2" in fctkit(*admin, "publish-root", "root/root.2.json")
        device("sync", "--dir", "D", "--quiet")
        status = device("status", "--dir", "D")
        assert status["trust"]["root_version"] == 2 and status["trust"]["freshness"].startswith("fresh")
        v2 = release(work / "export", 2, Path("keys/alice/publisher.key"))
        fctkit("keys", "sign", v2, "--key", "keys/bob/publisher.key")  # alice's leaked key + bob: one counts now
        refused(*admin, "publish", v2, match="1 valid signature.* of the 2 needed")
        upgrade = device_cli("upgrade", "--dir", "D", "--bundle", str(v2))
        assert upgrade.returncode != 0 and "1 valid signature" in upgrade.stderr
        fctkit("keys", "sign", v2, "--key", "keys/carol/publisher.key")
        fctkit(*admin, "publish", v2)
        assert device("sync", "--dir", "D", "--quiet")["installed_after"] == 2
    finally:
        server.stop()


def test_moving_an_existing_fleet_to_k_of_n(work, admin_token_file):  # noqa: F811 (a pytest fixture, imported from tests/server/conftest.py)
    fctkit("keys", "generate", "--out", "keys")  # the publisher key the fleet pins
    fctkit("keys", "generate", "--out", "keys/timestamp")
    fctkit("keys", "generate", "--out", "keys/bob")
    server = ServerProcess(work / "srv", work / "keys/publisher.pub", admin_token_file).start()
    try:
        fctkit(
            *("admin", "--server", server.target), "publish", release(work / "export", 1, Path("keys/publisher.key"))
        )
        fctkit("device", "init", "--dir", "D", "--publisher-key", "keys/publisher.pub")
        code = fctkit("admin", "--server", server.target, "enrol-code").splitlines()[0]
        device("enrol", "--dir", "D", "--server", server.target, "--code", code)
        assert device("sync", "--dir", "D", "--quiet")["installed_after"] == 1
        server.stop()

        fctkit(
            "keys",
            "init-root",
            "--out",
            "root/",
            "--root-keys",
            3,
            "--root-threshold",
            2,
            "--publisher-key",
            "keys/publisher.pub",
            "--timestamp-key",
            "keys/timestamp/publisher.pub",
        )
        fctkit("keys", "sign", "root/root.1.json", "--key", "keys/publisher.key")
        server.args = ["--root", "root/root.1.json", "--timestamp-key", "keys/timestamp/publisher.key"]
        server.start()
        device("sync", "--dir", "D", "--quiet")
        assert device("status", "--dir", "D")["trust"]["root_version"] == 1
        fctkit(
            "keys",
            "add-publisher",
            "root/root.1.json",
            "--key",
            "keys/bob/publisher.pub",
            "--threshold",
            2,
            "--sign-with",
            "root/root-1.key",
            "--sign-with",
            "root/root-2.key",
        )
        fctkit("admin", "--server", server.target, "publish-root", "root/root.2.json")
        device("sync", "--dir", "D", "--quiet")
        status = device("status", "--dir", "D")
        assert status["trust"]["root_version"] == 2 and status["installed_version"] == 1
    finally:
        server.stop()
