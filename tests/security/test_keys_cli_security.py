"""The offline key commands (issue 35) through click: init-root 2-of-3, three publishers added
with threshold 2, a release co-signed by two of them, a root rotation that revokes one, and the
refusals along the way (a root without enough signatures, a key that is not there)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from fctkit.errors import ReleaseSignatureError, ThresholdError, TrustError
from fctkit.export.keys import generate_keys, load_private_key, load_root_file
from fctkit.export.keys_cli import keys_command
from fctkit.protos.bundle import public_key_id
from fctkit.protos.trust import pin_root, read_release_signatures, verify_release, walk_root_chain
from tests.security.conftest import NOW

PASSPHRASE = "correct horse battery staple"


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.setenv("FCTKIT_KEY_PASSPHRASE", PASSPHRASE)
    return tmp_path


def keys(*args: str | Path) -> str:
    result = CliRunner().invoke(keys_command, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def publisher(workdir: Path, name: str) -> tuple[Path, Path]:
    return generate_keys(workdir / name, PASSPHRASE.encode())


def fingerprint(output: str) -> str:
    return next(line.split()[1] for line in output.splitlines() if line.startswith("fingerprint "))


@pytest.fixture
def root_v1(workdir):
    output = keys("init-root", "--out", workdir / "root", "--root-keys", 3, "--root-threshold", 2)
    assert "root v1:" in output and "(2 of 3 root keys)" in output
    return workdir / "root" / "root.1.json", fingerprint(output)


def add_publishers(workdir: Path, root_file: Path, names: tuple[str, ...]) -> Path:
    """One root version per publisher, the last one raising the threshold to 2; each signed by root keys 1 and 2."""
    signers = ["--sign-with", workdir / "root" / "root-1.key", "--sign-with", workdir / "root" / "root-2.key"]
    for i, name in enumerate(names):
        threshold = ["--threshold", 2] if i == len(names) - 1 else []
        keys("add-publisher", root_file, "--key", publisher(workdir, name)[1], *threshold, *signers)
        root_file = root_file.parent / f"root.{load_root_file(root_file).body.version + 1}.json"
    return root_file


def test_the_whole_offline_flow(workdir, root_v1, make_bundle):
    root_file, root_print = root_v1
    pinned = pin_root(root_file.read_bytes(), root_print)
    last = add_publishers(workdir, root_file, ("alice", "bob", "carol"))
    chain = [workdir / "root" / f"root.{v}.json" for v in (2, 3, 4)]
    assert last == chain[-1]
    trusted = walk_root_chain(pinned, [p.read_bytes() for p in chain], NOW).root
    assert trusted.body.role("publisher").threshold == 2 and len(trusted.body.role("publisher").keyids) == 3

    alice = load_private_key(workdir / "alice" / "publisher.key", PASSPHRASE.encode())
    release = make_bundle(workdir / "release" / "v2", alice).root
    manifest, alone = read_release_signatures(release)
    with pytest.raises(ReleaseSignatureError, match="1 valid signature"):
        verify_release(trusted, manifest, alone)
    assert "signed the release" in keys("sign", release, "--key", workdir / "bob" / "publisher.key")
    manifest, signatures = read_release_signatures(release)
    bob_id = public_key_id(load_private_key(workdir / "bob" / "publisher.key", PASSPHRASE.encode()).public_key())
    assert bob_id in verify_release(trusted, manifest, signatures)

    output = keys(
        "remove-publisher",
        last,
        "--key",
        workdir / "bob" / "publisher.pub",
        "--sign-with",
        workdir / "root" / "root-2.key",
        "--sign-with",
        workdir / "root" / "root-3.key",
    )
    assert "complete: signed by a threshold of the previous and its own root keys" in output
    revoked = walk_root_chain(trusted, [(workdir / "root" / "root.5.json").read_bytes()], NOW).root
    with pytest.raises(ReleaseSignatureError, match="outside the role do not count"):
        verify_release(revoked, manifest, signatures)
    assert "signed the release" in keys("sign", release, "--key", workdir / "carol" / "publisher.key")
    manifest, signatures = read_release_signatures(release)
    assert bob_id not in verify_release(revoked, manifest, signatures)


def test_a_root_without_enough_signatures_is_refused_unless_partial_and_then_co_signed(workdir, root_v1):
    root_file, _ = root_v1
    pub = publisher(workdir, "alice")[1]
    one = ["--sign-with", workdir / "root" / "root-1.key"]
    with pytest.raises(ThresholdError, match=r"root v2 not written: .*1 valid signature.*--partial"):
        CliRunner().invoke(
            keys_command, [str(a) for a in ("add-publisher", root_file, "--key", pub, *one)], catch_exceptions=False
        )
    assert not (workdir / "root" / "root.2.json").exists()
    assert "INCOMPLETE" in keys("add-publisher", root_file, "--key", pub, *one, "--partial")
    second = keys("sign", workdir / "root" / "root.2.json", "--key", workdir / "root" / "root-3.key")
    assert "signed root v2" in second and "complete: signed by a threshold of the previous" in second


def test_a_key_that_would_not_count_does_not_sign_a_root(workdir, root_v1):
    root_file, _ = root_v1
    before = root_file.read_bytes()
    with pytest.raises(TrustError, match="is not a root key of root v1"):
        CliRunner().invoke(
            keys_command, ["sign", str(root_file), "--key", str(publisher(workdir, "eve")[0])], catch_exceptions=False
        )
    assert root_file.read_bytes() == before


def test_show_prints_roles_thresholds_expiry_and_fingerprint(workdir, root_v1):
    root_file, root_print = root_v1
    table = keys("show", root_file)
    assert (
        f"fingerprint {root_print}" in table
        and "root       2 of 3" in table
        and "publisher  1 of 0 (never met" in table
    )
    info = json.loads(keys("show", root_file, "--json"))
    assert info["version"] == 1 and info["fingerprint"] == root_print and info["roles"]["root"]["threshold"] == 2
    assert info["status"].startswith("complete") and len(info["signatures"]) == 3


def test_the_root_keys_are_private_and_passphrase_wrapped(workdir, root_v1):
    key_file = workdir / "root" / "root-1.key"
    assert key_file.stat().st_mode & 0o077 == 0 and b"ENCRYPTED" in key_file.read_bytes()


def test_a_threshold_above_the_root_keys_writes_nothing(workdir):
    with pytest.raises(TrustError, match="can never be met"):
        CliRunner().invoke(
            keys_command,
            ["init-root", "--out", str(workdir / "r"), "--root-keys", "2", "--root-threshold", "3"],
            catch_exceptions=False,
        )
    assert not (workdir / "r").exists()


def test_removing_a_key_the_root_does_not_hold_is_refused(workdir, root_v1):
    root_file, _ = root_v1
    with pytest.raises(TrustError, match="is not a publisher key of this root"):
        CliRunner().invoke(
            keys_command,
            [
                "remove-publisher",
                str(root_file),
                "--key",
                "ab" * 32,
                "--sign-with",
                str(workdir / "root" / "root-1.key"),
            ],
            catch_exceptions=False,
        )


def test_every_root_command_explains_itself():
    for command in ("init-root", "add-publisher", "remove-publisher", "rotate-root", "sign", "show"):
        result = CliRunner().invoke(keys_command, [command, "--help"])
        assert result.exit_code == 0 and "Usage:" in result.output and len(result.output.splitlines()) > 5


def test_rotate_root_replaces_a_root_key_and_the_timestamp_key(workdir, root_v1):
    root_file, root_print = root_v1
    new_holder = publisher(workdir, "dana")[1]
    online = publisher(workdir, "online")[1]
    keys(
        "rotate-root",
        root_file,
        "--add-root-key",
        new_holder,
        "--remove-root-key",
        workdir / "root" / "root-3.pub",
        "--timestamp-key",
        online,
        "--sign-with",
        workdir / "root" / "root-1.key",
        "--sign-with",
        workdir / "root" / "root-2.key",
    )
    walk = walk_root_chain(
        pin_root(root_file.read_bytes(), root_print), [(workdir / "root" / "root.2.json").read_bytes()], NOW
    )
    assert walk.timestamp_keys_rotated and len(walk.root.body.role("root").keyids) == 3


def test_bundle_verify_with_a_root_checks_the_publisher_threshold(workdir, root_v1, make_bundle):
    from fctkit.export.cli import bundle_command

    last = add_publishers(workdir, root_v1[0], ("alice", "bob"))
    alice = load_private_key(workdir / "alice" / "publisher.key", PASSPHRASE.encode())
    release = make_bundle(workdir / "release" / "v2", alice).root
    runner = CliRunner()
    alone = runner.invoke(bundle_command, ["verify", str(release), "--root", str(last)])
    assert alone.exit_code != 0 and isinstance(alone.exception, ReleaseSignatureError), alone.output
    keys("sign", release, "--key", workdir / "bob" / "publisher.key")
    both = runner.invoke(bundle_command, ["verify", str(release), "--root", str(last)], catch_exceptions=False)
    assert both.exit_code == 0 and "signed by 2 publisher key(s) of the root" in both.output, both.output
    neither = runner.invoke(bundle_command, ["verify", str(release)])
    assert neither.exit_code == 2 and "exactly one of --public-key and --root" in neither.output
    (release / "embed.onnx").write_bytes(b"swapped")  # a threshold of signatures does not excuse a wrong hash
    assert runner.invoke(bundle_command, ["verify", str(release), "--root", str(last)]).exit_code != 0
