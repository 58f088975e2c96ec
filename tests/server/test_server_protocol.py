"""The wire protocol: committed stubs are fresh, the .proto files compile with a stock protoc,
and every RPC has an access rule."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
from google.protobuf import descriptor_pb2

from fctkit.protos import generate
from fctkit.server.auth import METHOD_ROLES, protocol_methods

PROTO_ROOT = generate.PROTO_ROOT
EXPECTED_RPCS = {
    "Registry": [
        "ListVersions",
        "GetManifest",
        "PlanUpgrade",
        "DownloadArtifact",
        "WatchVersions",
        "PublishBundle",
        "GetTrust",
        "PublishRoot",
        "SetRollout",
        "GetRollout",
        "Withdraw",
        "ConfirmVersion",
    ],
    "Vault": ["Upload", "Download", "Stat", "List", "Delete", "PushRecords", "PullRecords"],
    "Fleet": ["CreateEnrolmentCode", "Enrol", "Report", "ListDevices", "RevokeDevice"],
}


def test_committed_stubs_match_freshly_generated_ones():
    result = subprocess.run([sys.executable, "-m", "fctkit.protos.generate", "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_stale_stub_check_names_the_stale_file(tmp_path, monkeypatch):
    committed = tmp_path / "protos"
    committed.mkdir()
    for path in generate.PACKAGE_DIR.glob("*_pb2*"):
        shutil.copy(path, committed / path.name)
    (committed / "vault_pb2.pyi").write_text((committed / "vault_pb2.pyi").read_text() + "\n# edited by hand\n")
    (committed / "registry_pb2_grpc.py").unlink()
    (committed / "leftover_pb2.py").write_text("# from a proto file that no longer exists\n")
    monkeypatch.setattr(generate, "PACKAGE_DIR", committed)
    assert generate.stale_stubs() == ["leftover_pb2.py", "registry_pb2_grpc.py", "vault_pb2.pyi"]


def _protoc() -> list[str]:
    """A stock protoc when installed (apt-get install protobuf-compiler), else grpcio-tools' own."""
    system = shutil.which("protoc")
    return [system] if system else [sys.executable, "-m", "grpc_tools.protoc"]


def test_protos_compile_with_protoc_and_declare_the_three_services(tmp_path):
    sources = [str(p) for p in generate.proto_sources()]
    descriptor_set = tmp_path / "fctkit.pb"
    result = subprocess.run(
        [
            *_protoc(),
            f"-I{PROTO_ROOT}",
            f"--descriptor_set_out={descriptor_set}",
            "--include_imports",
            f"--python_out={tmp_path}",
            *sources,
        ],
        capture_output=True,
        text=True,
        cwd=PROTO_ROOT,
    )
    assert result.returncode == 0, result.stderr
    files = descriptor_pb2.FileDescriptorSet.FromString(descriptor_set.read_bytes()).file
    services = {s.name: [m.name for m in s.method] for f in files if f.package == "fctkit.v1" for s in f.service}
    assert services == EXPECTED_RPCS
    assert (tmp_path / "fctkit" / "v1" / "registry_pb2.py").exists()


def test_every_rpc_has_an_access_rule():
    expected = {f"/fctkit.v1.{service}/{rpc}" for service, rpcs in EXPECTED_RPCS.items() for rpc in rpcs}
    assert protocol_methods() == expected == set(METHOD_ROLES)
    assert (
        METHOD_ROLES["/fctkit.v1.Registry/PublishBundle"]
        == METHOD_ROLES["/fctkit.v1.Registry/PublishRoot"]
        == {"admin"}
    )
    assert METHOD_ROLES["/fctkit.v1.Registry/GetTrust"] == {"admin", "device"}
    assert METHOD_ROLES["/fctkit.v1.Registry/SetRollout"] == METHOD_ROLES["/fctkit.v1.Registry/GetRollout"] == {"admin"}
    assert (
        METHOD_ROLES["/fctkit.v1.Registry/Withdraw"] == METHOD_ROLES["/fctkit.v1.Registry/ConfirmVersion"] == {"admin"}
    )
    assert METHOD_ROLES["/fctkit.v1.Fleet/Enrol"] == frozenset()
    assert all(roles == {"device"} for method, roles in METHOD_ROLES.items() if method.startswith("/fctkit.v1.Vault/"))


@pytest.mark.parametrize("proto", sorted(p.name for p in (PROTO_ROOT / "fctkit" / "v1").glob("*.proto")))
def test_proto_files_name_the_versioned_package(proto):
    text = (PROTO_ROOT / "fctkit" / "v1" / proto).read_text()
    assert 'syntax = "proto3";' in text and "package fctkit.v1;" in text
