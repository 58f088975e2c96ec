"""fctkit.protos — the wire formats shared by server, devices and trainer."""

# The signed model bundle format (stdlib + cryptography only; see fctkit.protos.bundle).
from fctkit.protos.bundle import Artifact, Manifest, TensorSpec, VerifiedBundle, unpack_bundle, verify_bundle  # noqa: E402

__all__ = [*globals().get("__all__", []), "Artifact", "Manifest", "TensorSpec", "VerifiedBundle", "unpack_bundle", "verify_bundle"]
