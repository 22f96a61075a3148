"""Arguments are registered apart from what a command does: only the command layer (gpuforge.commands and
the top-level gpuforge.cli) builds parsers or reads a parsed Namespace; feature modules take typed values.
Each command is a class with register_arguments(parser) and execute(args), as aws-parallelcluster's
pcluster/cli/commands/common.py CliCommand (register_command_args apart from execute) does. Read from the
source (ast), so a registration anywhere in a feature module counts."""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
from pathlib import Path

from gpuforge import cli
from gpuforge.commands.base import Command, Group

PACKAGE = Path(__file__).resolve().parents[1] / "scripts" / "gpuforge"
LAYER = ("commands", "cli.py")
# A program of its own, not a gpuforge command: the maintainers' role README generator
# (`python -m gpuforge.roledoc`; tests/test_roledoc.py checks every README is current).
OWN_PROGRAMS = ("roledoc.py",)
PARSER_CALLS = {"add_argument", "add_parser", "add_subparsers", "add_argument_group", "set_defaults"}
PARSER_CLASSES = {"ArgumentParser", "Namespace"}


def _outside_the_layer() -> list[Path]:
    return [
        p
        for p in sorted(PACKAGE.rglob("*.py"))
        if p.relative_to(PACKAGE).parts[0] not in (*LAYER, *OWN_PROGRAMS)
    ]


def _parser_use(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and (node.attr in PARSER_CALLS or node.attr in PARSER_CLASSES):
            found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.attr}")
        elif isinstance(node, ast.Name) and node.id in PARSER_CLASSES:
            found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.id}")
    return found


def test_no_feature_module_registers_arguments_or_reads_a_namespace() -> None:
    assert _outside_the_layer()
    assert [use for path in _outside_the_layer() for use in _parser_use(path)] == []


def test_no_feature_module_registers_a_command() -> None:
    registering = [
        str(path.relative_to(PACKAGE))
        for path in _outside_the_layer()
        if any(
            isinstance(node, ast.FunctionDef) and node.name == "register"
            for node in ast.walk(ast.parse(path.read_text()))
        )
    ]
    assert registering == []


def _classes() -> list[type[Command | Group]]:
    found: list[type[Command | Group]] = []
    todo: list[type[Command | Group]] = [
        c for name in cli._COMMAND_MODULES for c in importlib.import_module(name).COMMANDS
    ]
    while todo:
        command = todo.pop()
        found.append(command)
        if issubclass(command, Group):
            todo.extend(command.commands)
    return found


def _leaf_parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return [parser]
    return [leaf for a in subs for sub in a.choices.values() for leaf in _leaf_parsers(sub)]


def test_every_command_parser_runs_a_command_class_s_execute() -> None:
    for parser in _leaf_parsers(cli.build_parser()):
        handler = parser._defaults["handler"]
        assert isinstance(handler.__self__, Command), parser.prog
        assert handler.__func__ is type(handler.__self__).execute, parser.prog


def test_every_command_is_a_class_that_registers_apart_from_executing() -> None:
    classes = _classes()
    assert len([c for c in classes if issubclass(c, Command)]) == len(_leaf_parsers(cli.build_parser()))
    for command in classes:
        assert issubclass(command, Command | Group), command
        assert not inspect.isabstract(command), command
        if issubclass(command, Command):
            assert set(inspect.signature(command.register_arguments).parameters) == {"self", "parser"}
            assert set(inspect.signature(command.execute).parameters) == {"self", "args"}


def test_each_command_module_is_listed_once_and_every_class_is_reachable() -> None:
    assert len(set(cli._COMMAND_MODULES)) == len(cli._COMMAND_MODULES)
    listed = {f"gpuforge.commands.{p.stem}" for p in (PACKAGE / "commands").glob("*.py")}
    listed -= {"gpuforge.commands.__init__", "gpuforge.commands.base", "gpuforge.commands.options"}
    assert listed == set(cli._COMMAND_MODULES)
    reachable = set(_classes())
    for name in cli._COMMAND_MODULES:
        module = importlib.import_module(name)
        defined = {
            c
            for c in vars(module).values()
            if inspect.isclass(c) and issubclass(c, Command | Group) and c.__module__ == name
        }
        assert defined <= reachable, name
