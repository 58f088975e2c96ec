"""Regenerate the Python stubs of the wire protocol: ``python -m fctkit.protos.generate``.

The sources are ``protos/proto-src/fctkit/v1/*.proto`` (proto package ``fctkit.v1``; the
folder name is not a Python identifier, so packaging treats it as data, not as a package). grpcio-tools
writes ``<name>_pb2.py``, ``<name>_pb2.pyi`` and ``<name>_pb2_grpc.py`` (the last only for
files that declare a service) next to this module, with their imports rewritten to be
relative so they work inside the ``fctkit.protos`` package. ``--check`` regenerates into a
temporary folder and exits 1 naming every committed stub that differs (stale stubs).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

from fctkit.errors import DependencyError, require

PACKAGE_DIR = Path(__file__).resolve().parent
PROTO_ROOT = PACKAGE_DIR / "proto-src"  # proto imports are written relative to it: "fctkit/v1/common.proto"
PROTO_SUBDIR = Path("fctkit") / "v1"
_ABSOLUTE_IMPORT = re.compile(r"^from fctkit\.v1 import (\w+_pb2)", re.MULTILINE)


def proto_sources() -> list[Path]:
    """The .proto files of the protocol, relative to :data:`PROTO_ROOT`."""
    return sorted(p.relative_to(PROTO_ROOT) for p in (PROTO_ROOT / PROTO_SUBDIR).glob("*.proto"))


def generate(out_dir: Path = PACKAGE_DIR) -> list[Path]:
    """Write the stubs into ``out_dir`` and return their paths."""
    protoc = require("grpc_tools.protoc", "dev")
    grpc_tools_include = Path(require("grpc_tools", "dev").__file__).parent / "_proto"
    sources = proto_sources()
    with tempfile.TemporaryDirectory() as raw:
        raw_dir = Path(raw)
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{grpc_tools_include}",
            f"--python_out={raw_dir}",
            f"--pyi_out={raw_dir}",
            f"--grpc_python_out={raw_dir}",
            *map(str, sources),
        ]
        if protoc.main(args) != 0:
            raise DependencyError(f"protoc failed on {', '.join(map(str, sources))}: see the messages above")
        written = []
        for generated in sorted((raw_dir / PROTO_SUBDIR).iterdir()):
            text = generated.read_text()
            if generated.name.endswith("_pb2_grpc.py") and "class " not in text:
                continue  # a file without services: its grpc module would be empty
            target = out_dir / generated.name
            target.write_text(_ABSOLUTE_IMPORT.sub(r"from . import \1", text))
            written.append(target)
    return written


def stale_stubs() -> list[str]:
    """Names of the committed stubs that differ from freshly generated ones (missing included)."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        expected = {p.name: p.read_bytes() for p in fresh}
    committed = {p.name for p in PACKAGE_DIR.iterdir() if re.fullmatch(r"\w+_pb2(_grpc)?\.pyi?", p.name)}
    stale = [
        n for n, data in expected.items() if not (PACKAGE_DIR / n).is_file() or (PACKAGE_DIR / n).read_bytes() != data
    ]
    return sorted(stale + [n for n in committed if n not in expected])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fctkit.protos.generate", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale stubs (exit 1 when any)")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_stubs()
        for name in stale:
            print(f"stale: {name}", file=sys.stderr)
        if stale:
            print("regenerate with: python -m fctkit.protos.generate", file=sys.stderr)
        return 1 if stale else 0
    for path in generate():
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
