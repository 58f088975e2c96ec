"""Signed bundles: build -> verify, and every kind of tampering is refused with its own error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fctkit.errors import BundleFormatError, GateError, HashMismatchError, RollbackError, SignatureError
from fctkit.protos.bundle import (
    MANIFEST_FILE,
    SIGNATURE_FILE,
    Manifest,
    public_key_id,
    verify_bundle,
    verify_manifest,
)

PASSING_GATE = {
    "cases": {"old/old": {"top1": 0.9}, "new/h(old)": {"top1": 0.92}},
    "ecc": {"forward_1_to_2": True, "backward_2_to_1": True},
}


@pytest.fixture()
def bundle(tmp_path, publisher_key, make_bundle):
    return make_bundle(tmp_path / "v2", publisher_key, gate=PASSING_GATE)


def _flip(path: Path, offset: int, mask: int = 0x01) -> None:
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= mask
    path.write_bytes(bytes(data))


def test_build_then_verify_round_trips_the_manifest(bundle, publisher_key):
    verified = verify_bundle(bundle.root, publisher_key.public_key(), installed_version=1)
    m = verified.manifest
    assert (m.version, m.parents, m.mode, m.embedding_dim, m.side_info_dim) == (2, (1,), "forward", 8, 4)
    assert [a.name for a in m.artifacts] == ["embed", "side_info", "forward_1_to_2", "backward_2_to_1"]
    forward = m.artifact("forward", source_version=1)
    assert [(s.name, s.shape, s.dtype) for s in forward.inputs] == [
        ("old_embedding", (None, 8), "float32"),
        ("old_side_info", (None, 4), "float32"),
    ]
    assert m.publisher_key_id == public_key_id(publisher_key.public_key())
    assert m.gate == {**PASSING_GATE, "forced": False, "force_reason": None}
    assert Manifest.from_bytes(m.canonical_bytes()) == m
    assert (bundle.root / MANIFEST_FILE).read_bytes() == m.canonical_bytes()
    assert sorted(p.name for p in bundle.root.iterdir()) == sorted(
        [MANIFEST_FILE, SIGNATURE_FILE] + [a.file for a in m.artifacts]
    )
    assert verified.read_artifact("embed") == (bundle.root / "embed.onnx").read_bytes()


def _flip_artifact(root: Path) -> None:
    _flip(root / "forward_1_to_2.onnx", 200)


def _flip_manifest(root: Path) -> None:
    _flip(root / MANIFEST_FILE, 40)


def _truncate_artifact(root: Path) -> None:
    path = root / "embed.onnx"
    path.write_bytes(path.read_bytes()[:-10])


def _truncate_signature(root: Path) -> None:
    path = root / SIGNATURE_FILE
    path.write_bytes(path.read_bytes()[:-1])


def _remove_signature(root: Path) -> None:
    (root / SIGNATURE_FILE).unlink()


def _remove_manifest(root: Path) -> None:
    (root / MANIFEST_FILE).unlink()


def _remove_artifact(root: Path) -> None:
    (root / "backward_2_to_1.onnx").unlink()


def _add_stray_file(root: Path) -> None:
    (root / "extra.onnx").write_bytes(b"not listed")


def _replace_artifact_with_symlink(root: Path) -> None:
    target = root.parent / "outside.onnx"
    shutil.move(root / "embed.onnx", target)
    (root / "embed.onnx").symlink_to(target)


TAMPERINGS = {
    "flip a byte of an artifact": (_flip_artifact, HashMismatchError, "modified or it was swapped"),
    "flip a byte of the manifest": (_flip_manifest, SignatureError, "manifest or the signature was modified"),
    "truncate an artifact": (_truncate_artifact, HashMismatchError, "truncated or replaced"),
    "truncate the signature": (_truncate_signature, SignatureError, "signature is truncated"),
    "remove the signature": (_remove_signature, SignatureError, "unsigned"),
    "remove the manifest": (_remove_manifest, BundleFormatError, "has no manifest.json"),
    "remove an artifact": (_remove_artifact, BundleFormatError, "is missing"),
    "add a stray file": (_add_stray_file, BundleFormatError, "does not list: extra.onnx"),
    "replace an artifact by a symlink": (_replace_artifact_with_symlink, BundleFormatError, "not a regular file"),
}


@pytest.mark.parametrize("name", list(TAMPERINGS))
def test_each_tampering_is_refused_with_its_own_error(bundle, publisher_key, name):
    tamper, error, message = TAMPERINGS[name]
    tamper(bundle.root)
    with pytest.raises(error, match=message):
        verify_bundle(bundle.root, publisher_key.public_key())


def test_the_tampering_messages_are_distinct():
    assert len({message for _, _, message in TAMPERINGS.values()}) == len(TAMPERINGS)


def test_swapping_an_artifact_between_two_bundles_is_refused(tmp_path, publisher_key, make_bundle):
    first = make_bundle(tmp_path / "a", publisher_key, seed=0)
    second = make_bundle(tmp_path / "b", publisher_key, seed=10)
    a, b = first.root / "forward_1_to_2.onnx", second.root / "forward_1_to_2.onnx"
    assert a.stat().st_size == b.stat().st_size and a.read_bytes() != b.read_bytes()
    swapped = a.read_bytes()
    a.write_bytes(b.read_bytes())
    b.write_bytes(swapped)
    for root in (first.root, second.root):
        with pytest.raises(HashMismatchError, match=r"forward_1_to_2.*swapped for another file"):
            verify_bundle(root, publisher_key.public_key())


def test_a_bundle_signed_with_another_key_is_refused(tmp_path, publisher_key, other_key, make_bundle):
    foreign = make_bundle(tmp_path / "foreign", other_key)
    with pytest.raises(SignatureError, match="comes from another publisher"):
        verify_bundle(foreign.root, publisher_key.public_key())


def test_a_flipped_byte_in_the_publisher_key_id_is_damage_not_another_publisher(bundle, publisher_key):
    """It used to read "signed by ff239551…, but this device pins ff239551…" (the same prefixes)."""
    path = bundle.root / MANIFEST_FILE
    data = path.read_bytes()
    at = data.index(public_key_id(publisher_key.public_key()).encode()) + 40
    path.write_bytes(data[:at] + (b"0" if data[at : at + 1] != b"0" else b"1") + data[at + 1 :])
    with pytest.raises(SignatureError, match="the manifest or the signature was modified"):
        verify_bundle(bundle.root, publisher_key.public_key())


def test_a_genuine_manifest_resigned_with_another_key_is_refused(bundle, publisher_key, other_key):
    manifest_bytes = (bundle.root / MANIFEST_FILE).read_bytes()
    (bundle.root / SIGNATURE_FILE).write_bytes(other_key.sign(manifest_bytes))
    with pytest.raises(SignatureError, match="manifest or the signature was modified"):
        verify_bundle(bundle.root, publisher_key.public_key())
    with pytest.raises(SignatureError, match=r"names publisher key .* but was signed by"):
        verify_bundle(bundle.root, other_key.public_key())


@pytest.mark.parametrize(("installed", "what"), [(2, "replay"), (3, "rollback")])
def test_rollback_and_replay_are_refused(bundle, publisher_key, installed, what):
    with pytest.raises(RollbackError, match=what):
        verify_bundle(bundle.root, publisher_key.public_key(), installed_version=installed)
    assert verify_bundle(bundle.root, publisher_key.public_key(), installed_version=1).manifest.version == 2


def _bundle_files(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


@pytest.fixture(scope="module")
def pristine_bundle(tmp_path_factory, publisher_key, make_bundle):
    return make_bundle(tmp_path_factory.mktemp("fuzz") / "v2", publisher_key)


@settings(max_examples=240, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_flipped_byte_is_refused(pristine_bundle, publisher_key, data):
    root = pristine_bundle.root
    name = data.draw(st.sampled_from(_bundle_files(root)), label="file")
    path = root / name
    original = path.read_bytes()
    offset = data.draw(st.integers(0, len(original) - 1), label="offset")
    mask = data.draw(st.integers(1, 255), label="xor mask")
    expected = {MANIFEST_FILE: SignatureError, SIGNATURE_FILE: SignatureError}.get(name, HashMismatchError)
    try:
        _flip(path, offset, mask)
        with pytest.raises(expected):
            verify_bundle(root, publisher_key.public_key())
    finally:
        path.write_bytes(original)
    verify_bundle(root, publisher_key.public_key())


def test_the_gate_refuses_a_failing_ecc_and_writes_nothing(tmp_path, publisher_key, make_bundle):
    failing = {"cases": PASSING_GATE["cases"], "ecc": {"forward_1_to_2": False, "backward_2_to_1": True}}
    with pytest.raises(GateError, match="forward_1_to_2"):
        make_bundle(tmp_path / "v2", publisher_key, gate=failing)
    missing = {"cases": {}, "ecc": {"forward_1_to_2": True}}
    with pytest.raises(GateError, match="backward_2_to_1"):
        make_bundle(tmp_path / "v2", publisher_key, gate=missing)
    assert not (tmp_path / "v2").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".v2.")], "staging folder left behind"


def test_force_records_the_override_in_the_signed_manifest(tmp_path, publisher_key, make_bundle):
    failing = {"cases": PASSING_GATE["cases"], "ecc": {"forward_1_to_2": False, "backward_2_to_1": True}}
    with pytest.raises(GateError, match="needs a reason"):
        make_bundle(tmp_path / "v2", publisher_key, gate=failing, force=True)
    forced = make_bundle(tmp_path / "v2", publisher_key, gate=failing, force=True, force_reason="hotfix for a crash")
    gate = verify_bundle(forced.root, publisher_key.public_key()).manifest.gate
    assert gate["forced"] is True and gate["force_reason"] == "hotfix for a crash"
    assert gate["ecc"]["forward_1_to_2"] is False


def test_gate_entries_must_name_bundled_artifacts(tmp_path, publisher_key, make_bundle):
    gate = {"cases": {}, "ecc": {**PASSING_GATE["ecc"], "forward_1_to_3": True}}
    with pytest.raises(BundleFormatError, match="forward_1_to_3"):
        make_bundle(tmp_path / "v2", publisher_key, gate=gate)
    with pytest.raises(GateError, match="unknown key"):
        make_bundle(tmp_path / "v3", publisher_key, gate={**PASSING_GATE, "forced": True})


def _resigned(bundle, key, edit) -> tuple[bytes, bytes]:
    raw = json.loads((bundle.root / MANIFEST_FILE).read_bytes())
    edit(raw)
    data = json.dumps(raw, sort_keys=True, separators=(",", ":")).encode()
    return data, key.sign(data)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m.update(surprise=1), "unknown key"),
        (lambda m: m.pop("distance"), "missing key"),
        (lambda m: m.update(version=True), "expected int"),
        (lambda m: m.update(parents=[2]), "lower than version"),
        (lambda m: m.update(embedding_dim=9), "embedding_dim is 9"),
        (lambda m: m.update(side_info_dim=0), "side_info_dim is 0"),
        (lambda m: m["artifacts"][0].update(file="../embed.onnx"), "plain file name"),
        (lambda m: m["artifacts"][2].update(target_version=3), "must map an older version to v2"),
        (lambda m: m["artifacts"][0]["outputs"][0].update(shape=[4, 8]), "dynamic batch"),
        (lambda m: m["gate"]["ecc"].update(forward_1_to_2=False), "no override is recorded"),
        (lambda m: m.update(format_version=2), "upgrade fctkit"),
    ],
)
def test_signed_but_inconsistent_manifests_are_refused(bundle, publisher_key, edit, message):
    data, signature = _resigned(bundle, publisher_key, edit)
    with pytest.raises(BundleFormatError, match=message):
        verify_manifest(data, signature, publisher_key.public_key())


def test_non_canonical_manifest_bytes_are_refused(bundle, publisher_key):
    raw = json.loads((bundle.root / MANIFEST_FILE).read_bytes())
    data = json.dumps(raw, sort_keys=True, indent=1).encode()
    with pytest.raises(BundleFormatError, match="canonical"):
        verify_manifest(data, publisher_key.sign(data), publisher_key.public_key())


def test_artifact_lookup_by_role_and_version(bundle):
    m = bundle.manifest
    assert m.artifact("backward").target_version == 1
    assert m.artifact("forward", source_version=1).name == "forward_1_to_2"
    with pytest.raises(BundleFormatError, match="no 'forward' from v3"):
        m.artifact("forward", source_version=3)
    with pytest.raises(BundleFormatError, match="no 'uncertainty'"):
        m.artifact("uncertainty")


def test_read_artifact_rechecks_the_bytes(bundle, publisher_key):
    verified = verify_bundle(bundle.root, publisher_key.public_key())
    _flip(bundle.root / "embed.onnx", 5)
    with pytest.raises(HashMismatchError, match="'embed'"):
        verified.read_artifact("embed")
