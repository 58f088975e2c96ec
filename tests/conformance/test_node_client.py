"""The Node conformance client (tests/conformance/client.js, @grpc/grpc-js from the npm registry,
written from docs/reference/protocol.md and the .proto files) against a real `fctkit serve` on loopback:
enrolment, versions, a verified manifest signature, a resumed artifact download, the vault
round trip with a resumed upload, a Watch that sees a publish, and the documented status codes.

`make test` installs the client's packages (`npm ci --prefix tests/conformance`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.server.conftest import (  # noqa: F401 (fixtures)
    ADMIN_TOKEN,
    admin_token_file,
    archives,
    backend,
    bundles,
    publisher_key,
    publisher_pub,
    start_server,
)

HERE = Path(__file__).resolve().parent
PROTO_DIR = HERE.parents[1] / "protos" / "proto-src"
CHECKS = [
    "enrol",
    "list versions",
    "manifest signature",
    "artifact download with resume",
    "vault upload, list, download, delete",
    "watch sees a publish",
    "status codes",
]


@pytest.fixture(scope="module")
def node() -> str:
    found = shutil.which("node")
    if found is None:
        pytest.skip("node is not installed: the conformance client needs Node.js 18+")
    if not (HERE / "node_modules" / "@grpc" / "grpc-js").is_dir():
        pytest.fail(
            "the conformance client's packages are missing: run `npm ci --prefix tests/conformance` (`make test` does)"
        )
    return found


def test_the_node_client_conforms(node, start_server, archives):  # noqa: F811 (a pytest fixture, imported from tests/server/conftest.py)
    from fctkit.protos.client import FctkitClient

    server = start_server()
    with FctkitClient(server.target, ADMIN_TOKEN) as admin:
        admin.publish_bundle(archives[1])
        codes = [admin.create_enrolment_code(label=f"node {owner}", owner=owner).code for owner in ("ann", "bob")]
    environment = {
        **os.environ,
        "FCTKIT_TARGET": server.target,
        "FCTKIT_PROTO_DIR": str(PROTO_DIR),
        "FCTKIT_CODE_A": codes[0],
        "FCTKIT_CODE_B": codes[1],
        "FCTKIT_ADMIN_TOKEN": ADMIN_TOKEN,
        "FCTKIT_PUBLISH_ARCHIVE": str(archives[2]),
    }
    run = subprocess.run([node, str(HERE / "client.js")], capture_output=True, text=True, timeout=120, env=environment)
    results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    failed = [r for r in results if not r["ok"]]
    assert failed == [] and run.returncode == 0, (failed, run.stderr[-2000:])
    assert [r["check"] for r in results] == CHECKS
    codes_seen = next(r["detail"] for r in results if r["check"] == "status codes")
    assert codes_seen == {
        "bad_token": "UNAUTHENTICATED",
        "no_token": "UNAUTHENTICATED",
        "device_as_admin": "PERMISSION_DENIED",
        "other_owners_blob": "PERMISSION_DENIED",
        "malformed_sha256": "INVALID_ARGUMENT",
        "undecodable_request": "INVALID_ARGUMENT",
    }
