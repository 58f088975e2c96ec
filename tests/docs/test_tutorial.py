"""The tutorial (docs/tutorial/first-model-update.md), run exactly as written.

The test holds no copy of the commands: it takes every ```bash block of the page, in order, and
runs them as one bash script (``set -e -o pipefail``) in a fresh temporary folder, with this
environment's ``bin/`` first on PATH. One rule: lines that start with ``pip install`` are left
out, since `make test` has installed the kit already. Then it checks what the page promises:
the device runs version 2 and its rows were moved there by the adapter. The script's process
group (the background server with it) is stopped whatever happens."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fctkit.edge_runtime import Device

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "tutorial" / "first-model-update.md"
BLOCK = re.compile(r"^```bash\n(?P<body>.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
INSTALL = re.compile(r"^\s*pip install\b")
PORT = 50051  # the page's server listens on fctkit serve's default port


def tutorial_script() -> str:
    blocks = [match.group("body") for match in BLOCK.finditer(PAGE.read_text())]
    assert len(blocks) >= 8, f"{PAGE.name}: expected the tutorial's bash blocks, found {len(blocks)}"
    lines = [line for body in blocks for line in body.splitlines() if not INSTALL.match(line)]
    return "\n".join(lines) + "\n"


def port_in_use(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def stop_group(process: subprocess.Popen) -> None:
    """SIGTERM to the script's process group (its background server included), SIGKILL after 15 s."""
    for sig, grace in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            try:
                os.killpg(process.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


def test_the_script_is_the_page():
    script = tutorial_script()
    assert "pip install" not in script
    for step in ("fctkit train", "fctkit export", "fctkit serve", "fctkit admin", "fctkit device sync", "kill"):
        assert step in script


def test_the_tutorial_runs_as_written(tmp_path):
    deadline = time.monotonic() + 60
    while port_in_use(PORT):  # another run of this test, or a server someone left
        if time.monotonic() > deadline:
            pytest.fail(f"127.0.0.1:{PORT}, the port the tutorial's server takes, stayed in use for 60 s")
        time.sleep(1)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("FCTKIT_SERVER", None)
    env.pop("FCTKIT_ADMIN_TOKEN", None)
    env.pop("FCTKIT_DEVICE", None)
    process = subprocess.Popen(
        ["bash", "-e", "-o", "pipefail", "-c", tutorial_script()],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=420)
    except subprocess.TimeoutExpired:
        stop_group(process)
        output, _ = process.communicate()
        pytest.fail(f"the tutorial did not finish in 420 s; its output ends:\n{output[-6000:]}")
    finally:
        stop_group(process)
    server_log = tmp_path / "runs" / "tutorial" / "server.log"
    log_tail = server_log.read_text()[-3000:] if server_log.is_file() else "(no server.log)"
    assert process.returncode == 0, f"the tutorial failed; its output ends:\n{output[-6000:]}\nserver.log:\n{log_tail}"

    with Device.open(tmp_path / "runs" / "tutorial" / "phone") as device:
        status = device.status()
    assert status["installed_version"] == 2, status
    assert status["rows"] == 300
    assert status["rows_by_space"].get("v1->v2 (forward)", 0) > 0, status["rows_by_space"]
    assert '"tag": "v1->v2 (forward)"' in output  # the last query searched the upgraded rows
    assert "ECC [FCT, side-info ψ] | PASS" in output
    # what the commands print is the kit's own: no library's warnings (the exporter's, torch's, ...)
    assert not re.findall(r"(?im)^.*warn.*$", output), re.findall(r"(?im)^.*warn.*$", output)
