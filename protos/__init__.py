"""fctkit.protos — the wire formats shared by server, devices and trainer."""

# The signed model bundle format (stdlib + cryptography only; see fctkit.protos.bundle).
from typing import Any

from fctkit.protos.bundle import Artifact, Manifest, TensorSpec, VerifiedBundle, unpack_bundle, verify_bundle

# Upgrade planning over bundle manifests (the server's catalogue, a device's installed bundles).
from fctkit.protos.planner import PlannedHop, plan_upgrade

__all__ = [
    *globals().get("__all__", []),
    "Artifact",
    "Manifest",
    "TensorSpec",
    "VerifiedBundle",
    "unpack_bundle",
    "verify_bundle",
    "PlannedHop",
    "plan_upgrade",
]

# The gRPC client library (fctkit.protos.client) imports grpc: loaded only when asked for.
_CLIENT_NAMES = ("FctkitClient", "RetryPolicy", "Transfer", "Enrolment")
__all__ += list(_CLIENT_NAMES)


def __getattr__(name: str) -> Any:
    if name in _CLIENT_NAMES:
        from fctkit.protos import client

        return getattr(client, name)
    raise AttributeError(f"module 'fctkit.protos' has no attribute {name!r}")
