"""Bearer-token authentication and per-method roles.

Every fctkit RPC names the roles allowed to call it (:data:`METHOD_ROLES`); the
:class:`AuthInterceptor` resolves ``authorization: Bearer <token>`` metadata to a
:class:`Principal` (the admin, or one enrolled device) before the handler runs, answers
UNAUTHENTICATED for a missing or unknown token and PERMISSION_DENIED for the wrong role, and
hands the principal to the handler through :func:`current_principal`. Tokens are never
stored: the admin token is compared by hash, device tokens are looked up by hash.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, cast

import grpc

from fctkit.errors import ConfigError, RpcStatusError
from fctkit.protos import fleet_pb2, registry_pb2, vault_pb2

from .revocation import OpenStreams
from .rpc import CALLER, wrap_handler

Role = Literal["admin", "device"]
PUBLIC: frozenset[Role] = frozenset()
ADMIN: frozenset[Role] = frozenset({"admin"})
DEVICE: frozenset[Role] = frozenset({"device"})
READERS: frozenset[Role] = frozenset({"admin", "device"})

METHOD_ROLES: dict[str, frozenset[Role]] = {
    "/fctkit.v1.Registry/ListVersions": READERS,
    "/fctkit.v1.Registry/GetManifest": READERS,
    "/fctkit.v1.Registry/PlanUpgrade": READERS,
    "/fctkit.v1.Registry/DownloadArtifact": READERS,
    "/fctkit.v1.Registry/WatchVersions": READERS,
    "/fctkit.v1.Registry/PublishBundle": ADMIN,
    "/fctkit.v1.Registry/GetTrust": READERS,
    "/fctkit.v1.Registry/PublishRoot": ADMIN,
    "/fctkit.v1.Registry/SetRollout": ADMIN,
    "/fctkit.v1.Registry/GetRollout": ADMIN,
    "/fctkit.v1.Registry/Withdraw": ADMIN,
    "/fctkit.v1.Registry/ConfirmVersion": ADMIN,
    "/fctkit.v1.Vault/Upload": DEVICE,
    "/fctkit.v1.Vault/Download": DEVICE,
    "/fctkit.v1.Vault/Stat": DEVICE,
    "/fctkit.v1.Vault/List": DEVICE,
    "/fctkit.v1.Vault/Delete": DEVICE,
    "/fctkit.v1.Vault/PushRecords": DEVICE,
    "/fctkit.v1.Vault/PullRecords": DEVICE,
    "/fctkit.v1.Fleet/CreateEnrolmentCode": ADMIN,
    "/fctkit.v1.Fleet/Enrol": PUBLIC,
    "/fctkit.v1.Fleet/Report": DEVICE,
    "/fctkit.v1.Fleet/ListDevices": ADMIN,
    "/fctkit.v1.Fleet/RevokeDevice": ADMIN,
}
SERVICE_MODULES = (registry_pb2, vault_pb2, fleet_pb2)
MIN_ADMIN_TOKEN_CHARS = 32


def protocol_methods() -> set[str]:
    """Every fctkit RPC as ``/package.Service/Method``, read from the compiled protocol."""
    return {
        f"/{service.full_name}/{method.name}"
        for module in SERVICE_MODULES
        for service in module.DESCRIPTOR.services_by_name.values()
        for method in service.methods
    }


def hash_secret(secret: str) -> str:
    """How tokens and enrolment codes are kept: SHA-256 hex (they carry >= 120 random bits)."""
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def new_device_token() -> str:
    return "fctd_" + secrets.token_urlsafe(32)


def load_or_create_admin_token(token_file: Path | None, data_dir: Path | None) -> tuple[str, Path]:
    """The admin token from ``token_file``, or from (newly made, mode 0600) ``DATA/admin.token``."""
    if token_file is None and data_dir is None:
        raise ConfigError("no admin token file: pass --admin-token-file")
    path = Path(token_file) if token_file else Path(cast(Path, data_dir)) / "admin.token"  # one of them is given
    if not path.exists():
        if token_file:
            raise ConfigError(
                f"admin token file not found: {path}; create it (at least {MIN_ADMIN_TOKEN_CHARS} characters) or leave --admin-token-file out to have one made in the data directory"
            )
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write("fcta_" + secrets.token_urlsafe(32) + "\n")
    token = path.read_text().strip()
    if len(token) < MIN_ADMIN_TOKEN_CHARS or any(c.isspace() for c in token):
        raise ConfigError(
            f"{path}: the admin token must be one line of at least {MIN_ADMIN_TOKEN_CHARS} non-space characters"
        )
    return token, path


@dataclass(frozen=True)
class Principal:
    role: Role
    device_id: str | None = None
    owner_id: str | None = None  # the owner a device belongs to

    @property
    def name(self) -> str:
        return self.device_id or self.role


def current_principal() -> Principal | None:
    """Who is calling the RPC being served (None for public methods)."""
    return CALLER.get()


def current_device_id() -> str:
    principal = CALLER.get()
    if principal is None or principal.device_id is None:
        raise RpcStatusError("PERMISSION_DENIED", "this call needs a device token")
    return principal.device_id


def current_owner_id() -> str:
    """The owner of the calling device (whose blobs and records it may reach)."""
    current_device_id()
    owner_id = CALLER.get().owner_id
    if owner_id is None:
        raise RpcStatusError("PERMISSION_DENIED", "this device belongs to no owner: enrol it again")
    return owner_id


class Authenticator:
    """Resolves bearer tokens: the admin token (compared by hash) or a device token (looked up by hash)."""

    def __init__(
        self,
        admin_token: str,
        device_for_token_hash: Callable[[str], str | None],
        device_owner: Callable[[str], str | None] = lambda device_id: None,
    ) -> None:
        self._admin_hash = hash_secret(admin_token)
        self._device_for_token_hash = device_for_token_hash
        self._device_owner = device_owner

    def principal(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Principal:
        value = next((v for k, v in metadata or () if k == "authorization"), None)
        if value is None:
            raise RpcStatusError("UNAUTHENTICATED", "missing `authorization: Bearer <token>` metadata")
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        scheme, _, token = value.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise RpcStatusError("UNAUTHENTICATED", "the authorization metadata must be `Bearer <token>`")
        token_hash = hash_secret(token)
        if hmac.compare_digest(token_hash, self._admin_hash):
            return Principal("admin")
        device_id = self._device_for_token_hash(token_hash)
        if device_id is None:
            raise RpcStatusError(
                "UNAUTHENTICATED",
                "unknown or revoked token: enrol the device again (with a new enrolment code) or check the admin token",
            )
        return Principal("device", device_id, self._device_owner(device_id))


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Checks every fctkit RPC against :data:`METHOD_ROLES`; other services (health checking,
    reflection) pass through untouched. Every fctkit RPC is also wrapped by
    :func:`fctkit.server.rpc.wrap_handler` (malformed requests, error mapping, access log)."""

    def __init__(self, authenticator: Authenticator, streams: OpenStreams | None = None) -> None:
        missing = protocol_methods() - set(METHOD_ROLES)
        if missing:
            raise ConfigError(f"RPCs without an access rule: {', '.join(sorted(missing))}")
        self._authenticator = authenticator
        self._streams = streams or OpenStreams()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        roles = METHOD_ROLES.get(handler_call_details.method)
        if handler is None or roles is None:
            return handler

        def authorize(context: grpc.aio.ServicerContext) -> Principal | None:
            if not roles:
                return None
            principal = self._authenticator.principal(context.invocation_metadata())
            CALLER.set(principal)
            if principal.role not in roles:
                raise RpcStatusError(
                    "PERMISSION_DENIED", f"{handler_call_details.method} needs {' or '.join(sorted(roles))} credentials"
                )
            return principal

        return wrap_handler(handler, handler_call_details.method, authorize, self._streams)
