"""Installs a Debian data package a benchmark needs (the only downloads benchmarks make).

Benchmarks never fetch data from dataset hosts or model hubs; what they read comes from the
distribution's packages, installed here with apt-get when the files are missing and we are root
(otherwise the error says the command to run).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable

from fctkit.errors import FctkitError


class BenchmarkSetupError(FctkitError):
    """A missing package or data file; the message says the command that provides it."""


def ensure_debian_package(package: str, present: Callable[[], bool], what: str) -> None:
    """Install ``package`` with apt-get unless ``present()`` already holds; check it afterwards."""
    if present():
        return
    command = ["apt-get", "install", "-y", "--no-install-recommends", package]
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise BenchmarkSetupError(f"{what} missing: run `sudo {' '.join(command)}`")
    print(f"installing {package} ...", flush=True)
    subprocess.run(["apt-get", "update", "-qq"], check=False)
    subprocess.run(command, check=True)
    if not present():
        raise BenchmarkSetupError(f"{what} still missing after installing {package}")
