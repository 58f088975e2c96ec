"""The kit installs as one `fctkit` namespace, and the device side runs without torch."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONSTRAINTS = REPO / "constraints.txt"

# Everything a device may import; none of it may pull in torch.
TORCH_FREE_MODULES = [
    "fctkit",
    "fctkit.cli",
    "fctkit.errors",
    "fctkit.config",
    "fctkit.trainer",
    "fctkit.trainer.evaluation",
    "fctkit.trainer.report",
    "fctkit.export",
    "fctkit.protos",
    "fctkit.server",
    "fctkit.edge_runtime",
    "fctkit.edge_runtime.adding",
    "fctkit.edge_runtime.item_sources",
    "fctkit.protos.preprocessing",
    "fctkit.protos.preprocessing_spec",
]

BLOCK_TORCH = textwrap.dedent(
    """
    import importlib.abc, sys
    class _NoTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError("torch is blocked: the device side must not need it")
    sys.meta_path.insert(0, _NoTorch())
    """
)


def _importable(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def test_device_side_imports_with_torch_blocked():
    modules = [m for m in TORCH_FREE_MODULES if _importable(m)]
    code = (
        BLOCK_TORCH
        + "\n".join(f"import {m}" for m in modules)
        + textwrap.dedent(
            """
        assert "torch" not in sys.modules
        from fctkit.cli import main
        try:
            main(["--help"])
        except SystemExit as exc:
            assert exc.code in (0, None), exc.code
        assert "torch" not in sys.modules, "fctkit --help imported torch"
        """
        )
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
def test_wheel_has_only_the_fctkit_namespace_and_installs_without_torch(tmp_path):
    wheel_dir = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheel_dir), str(REPO)],
        check=True,
        capture_output=True,
    )
    (wheel,) = wheel_dir.glob("fctkit-*.whl")
    top_level = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {t for t in top_level if not t.endswith(".dist-info")} == {"fctkit"}, top_level

    venv = tmp_path / "device-venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "-c", str(CONSTRAINTS), f"{wheel}[cpu]"],
        check=True,
        capture_output=True,
        env=env,
    )
    probe = "import importlib.util, sys\nassert importlib.util.find_spec('torch') is None\n" + "\n".join(
        f"import {m}" for m in TORCH_FREE_MODULES
    )
    proc = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, cwd="/", env=env)
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run([str(venv / "bin" / "fctkit"), "--version"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0 and "fctkit" in proc.stdout, proc.stderr


@pytest.mark.parametrize("torch_index", ["", "https://download.pytorch.org/whl/cpu"])
def test_make_passes_the_documented_torch_index_to_pip(torch_index):
    """`make test TORCH_INDEX=…` (README) reaches the install command; without it pip keeps its own indexes."""
    dry_run = subprocess.run(
        ["make", "-n", "-B", "install", f"TORCH_INDEX={torch_index}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    install = next(line for line in dry_run.splitlines() if "-c constraints.txt" in line)
    assert ("--extra-index-url" in install) == bool(torch_index)
    assert not torch_index or f"--extra-index-url {torch_index} " in install
