"""Every `fctkit …` command the kit's messages and docstrings suggest exists, with the flags
they name (issue 19 part 5): the hints are collected from the source and resolved against the
real click command tree."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest

from fctkit.cli import cli

REPO = Path(__file__).resolve().parents[2]
PARTS = ("core", "trainer", "export", "protos", "server", "edge_runtime")
HINT = re.compile(r"`(fctkit [^`]+)`|\((fctkit [a-z][^)]*)\)")
PLACEHOLDER = re.compile(r"^([A-Z][A-Z_:]*|\{[^}]*\}|\.\.\.|…|<.*)$")  # `[…]` brackets are dropped first


def suggested_commands() -> list[tuple[str, str]]:
    found = []
    for part in PARTS:
        for path in sorted((REPO / part).rglob("*.py")):
            for match in HINT.finditer(path.read_text()):
                found.append((str(path.relative_to(REPO)), match.group(1) or match.group(2)))
    return found


def resolve(command_line: str) -> str | None:
    """None when ``command_line`` names existing commands and flags, else what is wrong. It is read as
    the shell would (a quoted value is one token); ``[…]`` marks optional parts, and a group's own
    options may come before its subcommand (``fctkit admin --server HOST list-versions``)."""
    try:
        tokens = shlex.split(command_line.replace("[", " ").replace("]", " "))[1:]
    except ValueError as exc:
        return f"cannot split it as the shell would: {exc}"
    tokens = ["VALUE" if not token or any(c.isspace() for c in token) else token for token in tokens]
    command: click.Command = cli
    context = click.Context(cli)
    while tokens and isinstance(command, click.Group):
        token, tokens = tokens[0], tokens[1:]
        if token.startswith("-"):
            name = token.split("=")[0]
            option = next(
                (p for p in command.params if isinstance(p, click.Option) and name in p.opts + p.secondary_opts), None
            )
            if option is None and name not in ("-h", "--help"):
                return f"{command.name} has no option {token!r}"
            if option is not None and not option.is_flag and "=" not in token and tokens:
                tokens = tokens[1:]  # the option's value
            continue
        if PLACEHOLDER.match(token):
            return None  # `fctkit COMMAND --help`: any command
        sub = command.get_command(context, token)  # the root group loads its commands lazily
        if sub is None:
            return f"{command.name} has no command {token!r} (it has: {', '.join(command.list_commands(context))})"
        command = sub
    options = {
        name: param
        for param in command.params
        if isinstance(param, click.Option)
        for name in [*param.opts, *param.secondary_opts]
    }
    arguments = [param for param in command.params if isinstance(param, click.Argument)]
    positional, unknown = 0, []
    while tokens:
        token, tokens = tokens[0], tokens[1:]
        if token.startswith("-"):
            name = token.split("=")[0]
            if name == "--help":
                continue
            if name not in options:
                unknown.append(name)
            elif not options[name].is_flag and "=" not in token and tokens:
                tokens = tokens[1:]  # the option's value
        elif token not in ("...", "…"):
            positional += 1
    if unknown:
        return f"{command.name} has no option(s) {unknown}"
    if positional > len(arguments) and not any(a.nargs == -1 for a in arguments):
        return f"{command.name} takes {len(arguments)} positional argument(s), the hint gives {positional}"
    return None


def test_hints_are_found():
    assert len(suggested_commands()) > 20


@pytest.mark.parametrize("where, command_line", suggested_commands())
def test_each_suggested_command_exists(where, command_line):
    assert resolve(command_line) is None, f"{where}: `{command_line}`: {resolve(command_line)}"


def all_commands(command: click.Command, context: click.Context, path: str = "fctkit"):
    yield path, command
    if isinstance(command, click.Group):
        for name in command.list_commands(context):
            yield from all_commands(command.get_command(context, name), context, f"{path} {name}")


def test_every_command_that_connects_names_its_tls_options_the_same_way():
    """--tls-ca is the CA that signs the other side's certificate, --tls-cert/--tls-key this
    side's own identity: on `serve` (client CA, server identity) and on every client command."""
    tls = {"--tls-ca", "--tls-cert", "--tls-key"}
    connecting = {}
    for path, command in all_commands(cli, click.Context(cli)):
        names = {name for param in command.params for name in getattr(param, "opts", [])}
        if "--server" in names:
            connecting[path] = tls <= names
    assert len(connecting) >= 2 and all(connecting.values()), connecting
    serve = {
        name for param in cli.get_command(click.Context(cli), "serve").params for name in getattr(param, "opts", [])
    }
    assert tls <= serve
