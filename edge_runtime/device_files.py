"""The files of a device directory other than the gallery: their names, ``device.json`` (the
settings, validated when read) and the private write every one of them goes through."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from fctkit.config import from_mapping, to_mapping
from fctkit.errors import ConfigError, DeviceError
from fctkit.protos.trust import DEFAULT_CLOCK_TOLERANCE_S
from fctkit.upgrade_health import DEFAULT_SAMPLE_SIZE

from .engine import PREFERENCE, EngineConfig

SETTINGS_FILE, KEY_FILE, TOKEN_FILE, PUBLISHER_FILE, GALLERY_FILE = (
    "device.json",
    "device.key",
    "token",
    "publisher.pub",
    "gallery.sqlite",
)
OWNER_KEY_FILE = "owner.key"
MAX_HEALTH_SAMPLE = 4096  # rows an upgrade's health check may download and re-embed


@dataclass(frozen=True)
class DeviceSettings:
    """What ``device.json`` holds (unknown keys are errors)."""

    server: str | None = None
    device_id: str | None = None
    owner_id: str | None = None
    device_name: str = ""
    tls_root_certificates: str | None = None
    tls_client_cert: str | None = None
    tls_client_key: str | None = None
    providers: tuple[str, ...] = PREFERENCE
    batch_size: int = 1024
    threads: int = 0
    search_backend: str = "auto"
    clock_tolerance_s: int = DEFAULT_CLOCK_TOLERANCE_S  # how far past expiry a root or timestamp is still accepted
    health_sample: int = (
        DEFAULT_SAMPLE_SIZE  # rows re-embedded after each upgrade to measure it (0: no health check; .upgrade_check)
    )

    @property
    def engine(self) -> EngineConfig:
        return EngineConfig(providers=tuple(self.providers), batch_size=self.batch_size, threads=self.threads)


def read_settings(path: Path) -> DeviceSettings:
    """``device.json``, validated; a damaged file is a :class:`DeviceError` that says what to do."""
    try:
        settings = from_mapping(DeviceSettings, json.loads(path.read_bytes().decode("utf-8")), SETTINGS_FILE)
        EngineConfig(tuple(settings.providers), settings.batch_size, settings.threads)  # checks providers and sizes
        if not isinstance(settings.providers, (list, tuple)) or not all(isinstance(p, str) for p in settings.providers):
            raise ConfigError("providers must be a list of names")
        for name in ("server", "device_id", "owner_id", "tls_root_certificates", "tls_client_cert", "tls_client_key"):
            if not isinstance(getattr(settings, name), (str, type(None))):
                raise ConfigError(f"{name} must be a string or null")
        if not isinstance(settings.device_name, str) or settings.search_backend not in ("auto", "numpy", "faiss"):
            raise ConfigError("device_name must be a string and search_backend one of auto, numpy, faiss")
        if type(settings.clock_tolerance_s) is not int or not 0 <= settings.clock_tolerance_s <= 86400:
            raise ConfigError("clock_tolerance_s must be a whole number of seconds from 0 to 86400")
        if type(settings.health_sample) is not int or not 0 <= settings.health_sample <= MAX_HEALTH_SAMPLE:
            raise ConfigError(f"health_sample must be a whole number of rows from 0 (off) to {MAX_HEALTH_SAMPLE}")
    except (ValueError, TypeError, ConfigError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise DeviceError(
            f"{path} is damaged ({exc}); restore it, or edit it back to valid settings "
            f"(the keys and the gallery were not touched)"
        ) from None
    return settings


def write_settings(path: Path, settings: DeviceSettings) -> None:
    write_private(path, json.dumps(to_mapping(settings), indent=2).encode())


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` with mode 0600 through a temporary file and a rename."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
