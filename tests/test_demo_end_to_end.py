"""`fctkit demo` end to end on digits with 2 devices: the table's facts hold (ECC, every
device upgraded to v2 with adapted rows, the backfill kept or improved top-1), the report
files exist, and the server subprocess is gone afterwards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fctkit.demo import CASES, DemoOptions, run_demo

pytestmark = pytest.mark.slow


def test_demo_on_digits_with_two_devices(tmp_path):
    lines: list[str] = []
    result = run_demo(DemoOptions(devices=2, out=tmp_path / "demo", progress=False), log=lines.append)
    report = result.report

    overall = report["overall"]
    assert report["ecc"]["holds"]
    assert overall["new/h(old)"]["top1"] > overall["old/old"]["top1"]
    assert overall["new/h(old)"]["top1"] > overall["new/old"]["top1"]  # the adapter is what makes v2 usable

    assert set(report["per_device"]) == {"device-1", "device-2"}
    for name, device in report["per_device"].items():
        assert device["version"] == 2
        assert device["rows_by_space_after_upgrade"] == {"v1->v2 (forward)": device["rows"]}
        assert set(device["cases"]) == set(CASES)
    assert sum(d["rows"] for d in report["per_device"].values()) == report["rows"]

    backfilled = report["per_device"]["device-1"]
    rows = report["backfill"]["rows"]
    assert rows == round(0.3 * backfilled["rows"]) and report["backfill"]["bytes_downloaded"] > 0
    assert backfilled["rows_by_space"] == {"v1->v2 (forward)": backfilled["rows"] - rows, "v2": rows}
    assert backfilled["cases"]["after backfill"]["top1"] >= backfilled["cases"]["new/h(old)"]["top1"]
    untouched = report["per_device"]["device-2"]["cases"]
    assert untouched["after backfill"] == untouched["new/h(old)"]

    assert report["bytes"]["backfill_downloads"] < report["bytes"]["full_reembed_downloads"]
    assert report["bytes"]["vault_uploads"] > 0 and report["bytes"]["bundle_v2"] > 0

    assert result.server_pid is not None and not Path(f"/proc/{result.server_pid}").exists()
    for path in result.files.values():
        assert path.is_file() and path.stat().st_size > 0
    assert json.loads(result.files["json"].read_text())["overall"] == overall
    table = result.files["markdown"].read_text()
    assert "after backfill" in table and "new/h(old)" in table
    assert any("new/h(old)" in line for line in lines)


def test_ctrl_c_leaves_no_server_running(tmp_path):
    """SIGINT (Ctrl-C) once the server is up: the demo exits 130 and its server is gone."""
    import os
    import re
    import signal
    import subprocess
    import sys

    process = subprocess.Popen([sys.executable, "-m", "fctkit.cli", "demo", "--devices", "1", "--quiet", "--out", str(tmp_path / "demo")],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    server_pid = None
    for line in process.stdout:
        found = re.search(r"server pid (\d+) listening", line)
        if found:
            server_pid = int(found.group(1))
            break
    assert server_pid is not None, "the demo never started its server"
    assert Path(f"/proc/{server_pid}").exists()
    process.send_signal(signal.SIGINT)
    process.stdout.read()
    assert process.wait(60) == 130
    try:
        os.kill(server_pid, 0)
        reaped = False
    except ProcessLookupError:
        reaped = True
    assert reaped, f"server {server_pid} is still running after Ctrl-C"
