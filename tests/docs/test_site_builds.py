"""The documentation site: `mkdocs build --strict` succeeds (no broken link, anchor or
cross-reference, no page missing from the nav, no config or format key without a meaning), the
generated reference pages hold every command, exported name and config key, and every `fctkit …`
command the pages and the README show exists with the flags they give."""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import click
import pytest

from fctkit.cli import cli
from tests.foundation.test_cli_hints import all_commands, resolve

REPO = Path(__file__).resolve().parents[2]
MKDOCS = Path(sys.executable).with_name("mkdocs")
PARTS = {
    "fctkit": "core",
    "fctkit.trainer": "trainer",
    "fctkit.export": "export",
    "fctkit.edge_runtime": "edge_runtime",
    "fctkit.protos": "protos",
    "fctkit.server": "server",
}


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built once for this module's tests."""
    if not MKDOCS.is_file():
        pytest.fail(f"{MKDOCS} is missing: install the docs extra (make test does: EXTRAS includes docs)")
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [str(MKDOCS), "build", "--strict", "--site-dir", str(out)],
        cwd=REPO,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # Material's banner about its successor, not ours
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    return out


def page(site: Path, name: str) -> str:
    return (site / name / "index.html").read_text()


def test_the_site_builds_strictly(site):
    assert (site / "index.html").is_file() and (site / "tutorial" / "first-model-update" / "index.html").is_file()


def test_the_cli_reference_shows_every_command(site):
    """mkdocs-click walks the root group, which loads its subcommands lazily: all must be there."""
    html = page(site, "reference/cli")
    paths = [path for path, _ in all_commands(cli, click.Context(cli))]
    assert len(paths) > 40 and {"fctkit device upgrade", "fctkit admin rollout"} <= set(paths)
    missing = [path for path in paths if f'id="{path.replace(" ", "-")}"' not in html]
    assert not missing, f"commands missing from reference/cli.md: {missing}"


@pytest.mark.parametrize("package", list(PARTS))
def test_the_api_reference_shows_every_exported_name(site, package):
    html = page(site, f"reference/api/{PARTS[package]}")
    names = importlib.import_module(package).__all__
    missing = [name for name in names if f"<code>{name}</code>" not in html]
    assert not missing, f"{package}.__all__ names missing from reference/api/{PARTS[package]}.md: {missing}"


def leaf_keys(cls: type, default: object, prefix: str = "") -> list[str]:
    """The dotted keys of a section as its table lists them (``train.epochs`` in ``[fct]``)."""
    keys = []
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        value = getattr(default, field.name)
        nested = dataclasses.is_dataclass(hints[field.name])
        keys += leaf_keys(type(value), value, f"{prefix}{field.name}.") if nested else [f"{prefix}{field.name}"]
    return keys


def test_the_configuration_reference_shows_every_key(site):
    from fctkit.edge_runtime.device_files import DeviceSettings
    from fctkit.trainer.compatible_config import CompatibleConfig
    from fctkit.trainer.pipeline_config import PipelineConfig

    html = page(site, "reference/configuration")
    shown = set(re.findall(r"<code>([^<]+)</code>", html))
    for cls in (PipelineConfig, CompatibleConfig):
        default, hints = cls(), typing.get_type_hints(cls)
        missing = []
        for field in dataclasses.fields(cls):
            if not dataclasses.is_dataclass(hints[field.name]):
                missing += [] if field.name in shown else [field.name]
                continue
            missing += [] if f"[{field.name}]" in shown else [f"[{field.name}]"]
            value = getattr(default, field.name)
            missing += [f"{field.name}.{key}" for key in leaf_keys(type(value), value) if key not in shown]
        assert not missing, f"{cls.__name__}: keys missing from reference/configuration.md: {missing}"
    assert {f.name for f in dataclasses.fields(DeviceSettings)} <= shown


# --- every `fctkit …` command the docs show exists ------------------------------------------------

FENCE = re.compile(
    r"^(?P<indent>[ \t]*)(?P<fence>```+|~~~+)(?P<info>[^\n]*)\n(?P<body>.*?)^(?P=indent)(?P=fence)[ \t]*$",
    re.MULTILINE | re.DOTALL,
)
SHELL = ("bash", "sh", "shell", "console")
INLINE = re.compile(r"(?<!`)`(fctkit [^`\n]+)`(?!`)")
START = re.compile(r"(?<![\w/.$-])fctkit(?=[ \t])")
#: where a command ends on a shell line: an operator, a closing `$(…)`, a redirection, a pipe
END = re.compile(r"\s*(?:&&|\|\||;|\\?\||\)|&|<|`|\s\d*>|>)")


def shell_commands(body: str) -> list[str]:
    """The `fctkit …` commands of a shell block: continuation lines joined, comments dropped,
    each command cut at the first operator, pipe or redirection."""
    found = []
    for line in re.sub(r"\\\n", " ", body).splitlines():
        line = re.sub(r"(^|\s)#.*$", "", line)
        for match in START.finditer(line):
            rest = line[match.start() :]
            cut = END.search(rest)
            found.append((rest[: cut.start()] if cut else rest).strip())
    return found


def documented_commands() -> list[tuple[str, str]]:
    """(file, command) for every `fctkit …` in a shell code block or an inline code span of
    docs/**/*.md and README.md."""
    found = []
    for path in [*sorted((REPO / "docs").rglob("*.md")), REPO / "README.md"]:
        text = path.read_text()
        where = str(path.relative_to(REPO))
        for fence in FENCE.finditer(text):
            if fence.group("info").strip().split(" ")[0] in SHELL:
                found += [(where, command) for command in shell_commands(fence.group("body"))]
        for span in INLINE.finditer(FENCE.sub("", text)):
            found += [(where, command) for command in shell_commands(span.group(1))]
    return found


def test_the_docs_show_fctkit_commands():
    commands = documented_commands()
    assert len(commands) > 50
    assert resolve("fctkit admin --server h:1 publish v2.tar --percent 5") is None
    assert resolve("fctkit admin --no-such-flag list-versions") is not None
    assert resolve('fctkit admin withdraw 3 --reason "two words" --key k') is None


@pytest.mark.parametrize("where, command_line", documented_commands())
def test_each_documented_command_exists(where, command_line):
    problem = resolve(command_line)
    assert problem is None, f"{where}: `{command_line}`: {problem}"
