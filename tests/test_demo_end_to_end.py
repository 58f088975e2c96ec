"""`fctkit demo` end to end on digits with 2 devices: the table's facts hold (ECC, every
device upgraded to v2 with adapted rows, a partly backfilled gallery still beats old/old), the report
files exist, and the server subprocess is gone afterwards."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fctkit.demo import CASES, DemoOptions, run_demo
from fctkit.demo.phases import Phases
from fctkit.edge_runtime import Device
from tests.support.seeds import seed

pytestmark = pytest.mark.slow


def test_demo_on_digits_with_two_devices(tmp_path, capfd):
    lines: list[str] = []
    result = run_demo(DemoOptions(devices=2, out=tmp_path / "demo", seed=seed(), progress=False), log=lines.append)
    report = result.report
    # without progress bars the demo's lines are all it says: no library's warnings on the terminal
    assert capfd.readouterr() == ("", "")

    overall = report["overall"]
    assert report["ecc"]["holds"]
    assert overall["new/h(old)"]["top1"] > overall["old/old"]["top1"]
    assert overall["new/h(old)"]["top1"] > overall["new/old"]["top1"]  # the adapter is what makes v2 usable

    assert set(report["per_device"]) == {"device-1", "device-2"}
    for device in report["per_device"].values():
        assert device["version"] == 2
        assert device["rows_by_space_after_upgrade"] == {"v1->v2 (forward)": device["rows"]}
        assert set(device["cases"]) == set(CASES)
    assert sum(d["rows"] for d in report["per_device"].values()) == report["rows"]

    backfilled = report["per_device"]["device-1"]
    rows = report["backfill"]["rows"]
    assert rows == round(0.3 * backfilled["rows"]) and report["backfill"]["bytes_downloaded"] > 0
    assert backfilled["rows_by_space"] == {"v1->v2 (forward)": backfilled["rows"] - rows, "v2": rows}
    # a mixed gallery (30% re-embedded, the rest adapted) still beats not upgrading; it need not beat
    # the adapted one: on class-level digits h(old) can score above φ_new itself (seed 1: 0.969 vs 0.975)
    assert backfilled["cases"]["after backfill"]["top1"] > backfilled["cases"]["old/old"]["top1"]
    untouched = report["per_device"]["device-2"]["cases"]
    assert untouched["after backfill"] == untouched["new/h(old)"]

    assert report["bytes"]["backfill_downloads"] < report["bytes"]["full_reembed_downloads"]
    assert report["bytes"]["vault_uploads"] > 0 and report["bytes"]["bundle_v2"] > 0

    for name in report["per_device"]:  # enrolled by the root's fingerprint: the root pinned, the timestamp fresh
        with Device.open(tmp_path / "demo" / "devices" / name) as device:
            trust = device.status()["trust"]
        assert trust["root_version"] == 1 and trust["freshness"].startswith("fresh")

    assert result.server_pid is not None and not Path(f"/proc/{result.server_pid}").exists()
    for path in result.files.values():
        assert path.is_file() and path.stat().st_size > 0
    assert json.loads(result.files["json"].read_text())["overall"] == overall
    table = result.files["markdown"].read_text()
    assert "after backfill" in table and "new/h(old)" in table
    assert any("new/h(old)" in line for line in lines)


#: Where the Ctrl-C tests interrupt: a line the demo prints (a regular expression). Each is
#: followed by seconds of work (three devices enrol one by one), so the signal lands while the
#: demo runs even on a loaded machine: a demo that has already finished exits 0 whatever it does.
SERVER_UP = r"server pid (\d+) listening"
INTERRUPT_MOMENTS = {
    "training": r"\] train v1 .*\.\.\.$",
    "server up": SERVER_UP,
    "devices enrolling": r"\] enrol 3 devices.*\.\.\.$",
}


@pytest.mark.parametrize("moment", list(INTERRUPT_MOMENTS))
def test_ctrl_c_stops_the_demo_in_any_phase_and_leaves_no_server_running(tmp_path, moment):
    """SIGINT (Ctrl-C) in each phase: the demo exits 130 and the server it started is gone."""
    process = subprocess.Popen(
        [sys.executable, "-m", "fctkit.cli", "demo", "--devices", "3", "--quiet", "--out", str(tmp_path / "demo")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    server_pid, seen = None, []
    for line in process.stdout:
        seen.append(line)
        found = re.search(SERVER_UP, line)
        server_pid = int(found.group(1)) if found else server_pid
        if re.search(INTERRUPT_MOMENTS[moment], line.rstrip()):
            break
    else:
        pytest.fail(f"the demo ended before {moment!r}: {''.join(seen[-5:])}")
    process.send_signal(signal.SIGINT)
    rest = process.stdout.read()
    assert process.wait(60) == 130, rest[-2000:]
    if server_pid is not None:
        assert not _alive(server_pid), f"server {server_pid} is still running after Ctrl-C"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the dropped exception itself
def test_an_interrupt_python_drops_in_a_finalizer_still_stops_the_demo():
    """Python drops an exception raised inside ``__del__`` ("Exception ignored in ..."): a
    Ctrl-C that lands while a finalizer runs must still stop the run at the phase's end."""
    lines: list[str] = []
    phases = Phases(lines.append)

    class Finalized:
        def __del__(self) -> None:
            os.kill(os.getpid(), signal.SIGINT)  # the handler runs here, in the finalizer

    carried_on = False
    previous = signal.getsignal(signal.SIGINT)
    with phases.interrupts.installed(), pytest.raises(KeyboardInterrupt):
        with phases("one"):
            Finalized()  # collected at once; its KeyboardInterrupt is dropped by Python
            carried_on = True
        lines.append("not reached")
    assert carried_on and len(lines) == 2 and lines[0] == "[1] one ..." and lines[1].startswith("[1] one: ")
    assert phases.interrupts.received == signal.SIGINT
    assert signal.getsignal(signal.SIGINT) is previous  # the handlers are put back
