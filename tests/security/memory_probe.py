"""Run one ``fctkit`` command in this process and report how much memory it took (the endless-data
tests of :mod:`tests.security.test_endless_paging_security`).

``python -m tests.security.memory_probe REPORT LIMIT_MIB ARGS...`` loads the command line and the
client library, notes the resident memory (the base), resets the kernel's peak (``VmHWM``), runs
``fctkit ARGS...`` and writes ``{"exit_code", "base_mib", "growth_mib", "over_limit"}`` to the
JSON file REPORT: ``growth_mib`` is the peak resident memory during the command less the base. A
watchdog thread ends the process (exit :data:`OVER_LIMIT_EXIT`) as soon as the growth passes
LIMIT_MIB, so that a client that never stops fails its test without filling the machine. Linux only
(``/proc``)."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import threading
import time
from pathlib import Path

OVER_LIMIT_EXIT = 99
LOADED_FIRST = ("fctkit.cli", "fctkit.edge_runtime.cli", "fctkit.protos.client", "fctkit.server.cli")
"""What the commands load, loaded before the base is taken."""
MIB = 1 << 20


def _status_kib(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


class Probe:
    """The base taken at start, and the report written once the command ended or went over."""

    def __init__(self, report: Path, limit_mib: float) -> None:
        self.report, self.limit_mib = report, limit_mib
        with contextlib.suppress(OSError):  # where the kernel refuses, the peak counts the imports too (higher)
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM starts again from the current VmRSS
        self.base_kib = _status_kib("VmRSS")

    def growth_mib(self) -> float:
        return (_status_kib("VmHWM") - self.base_kib) / 1024

    def write(self, exit_code: int, over_limit: bool) -> None:
        record = {
            "exit_code": exit_code,
            "base_mib": self.base_kib / 1024,
            "growth_mib": self.growth_mib(),
            "over_limit": over_limit,
        }
        self.report.write_text(json.dumps(record))

    def watch(self) -> None:
        while True:
            if self.growth_mib() > self.limit_mib:
                self.write(OVER_LIMIT_EXIT, over_limit=True)
                os._exit(OVER_LIMIT_EXIT)
            time.sleep(0.005)


def main(report: str, limit_mib: str, *args: str) -> int:
    for module in LOADED_FIRST:
        importlib.import_module(module)
    from fctkit.cli import main as fctkit_main

    probe = Probe(Path(report), float(limit_mib))
    threading.Thread(target=probe.watch, daemon=True).start()
    try:
        fctkit_main(list(args))
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    probe.write(code, over_limit=False)
    return code


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
