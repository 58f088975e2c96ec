"""How to rebuild a device's gallery from the owner's replica when it cannot be repaired in place.

:func:`rebuild_advice` spells the steps as commands that work for that very device: its directory
moved aside, a new device with the same owner key, enrolled the way the old one trusted its
server (from its newest root file, or pinning the same publisher key; one that pinned nothing
needs the root's fingerprint), at the server and with the TLS files its settings name, then a
sync that pulls the rows back.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from fctkit.errors import FctkitError

from .device_files import OWNER_KEY_FILE, PUBLISHER_FILE, SETTINGS_FILE, DeviceSettings, read_settings
from .device_trust import TRUST_DIR

#: how every rebuild advice starts (the CLI cuts a message there to keep its reason alone)
REBUILD_LEAD = "rebuild it from the owner's replica"


def rebuild_advice(device_dir: Path) -> str:
    """The commands that rebuild ``device_dir``'s gallery from the owner's replica (CODE: an enrolment
    code for the same owner; HOST:PORT where the device's settings name no server)."""
    device_dir = Path(device_dir)
    old = device_dir.with_name(device_dir.name + ".damaged")
    settings = _settings(device_dir)
    init_pin, enrol_pin = _pins(device_dir, old)
    here = ["--dir", str(device_dir)]
    server = ["--server", settings.server or "HOST:PORT", "--code", "CODE"]
    steps = (
        ["mv", str(device_dir), str(old)],
        ["fctkit", "device", "init", *here, "--import-key", str(old / OWNER_KEY_FILE), *init_pin],
        ["fctkit", "device", "enrol", *here, *server, *_tls(settings), *enrol_pin],
        ["fctkit", "device", "sync", *here],
    )
    move, init, enrol, sync = (f"`{shlex.join(step)}`" for step in steps)
    return (
        f"{REBUILD_LEAD}: {move}, {init}, {enrol} (CODE: a code for the same owner, from "
        f"`fctkit admin enrol-code --owner NAME`) and {sync} (rows not yet pushed are lost)"
    )


def _settings(device_dir: Path) -> DeviceSettings:
    try:
        return read_settings(device_dir / SETTINGS_FILE)
    except (FctkitError, OSError):  # damaged or gone: the steps say HOST:PORT and name no TLS files
        return DeviceSettings()


def _pins(device_dir: Path, old: Path) -> tuple[list[str], list[str]]:
    """(init flags, enrol flags) that trust the server as the device did: its newest root file, or
    its pinned publisher key; with neither, the root's fingerprint (from `fctkit keys init-root`)."""
    roots = sorted(_root_versions(device_dir / TRUST_DIR))
    if roots:
        return [], ["--root", str(old / TRUST_DIR / f"root.{roots[-1]}.json")]
    if (device_dir / PUBLISHER_FILE).is_file():
        return ["--publisher-key", str(old / PUBLISHER_FILE)], []
    return [], ["--root-fingerprint", "SHA256"]


def _root_versions(folder: Path) -> list[int]:
    names = [p.name.split(".") for p in folder.glob("root.*.json")] if folder.is_dir() else []
    return [int(parts[1]) for parts in names if len(parts) == 3 and parts[1].isdigit()]


def _tls(settings: DeviceSettings) -> list[str]:
    flags = zip(
        ("--tls-ca", "--tls-cert", "--tls-key"),
        (settings.tls_root_certificates, settings.tls_client_cert, settings.tls_client_key),
        strict=True,
    )
    return [part for flag, path in flags if path for part in (flag, path)]
