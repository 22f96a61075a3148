"""What a command is: its name and help, its arguments, and what it does with them."""

from __future__ import annotations

import argparse
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar


class Command(ABC):
    """One `gpuforge` command (or one action under a group, e.g. `cluster-config generate`)."""

    name: ClassVar[str]
    help: ClassVar[str]
    description: ClassVar[str | None] = None
    formatter_class: ClassVar[type[argparse.HelpFormatter]] = argparse.HelpFormatter

    def add_to(self, subparsers: Any) -> argparse.ArgumentParser:
        """Add this command's parser under subparsers; parsing it selects execute."""
        parser: argparse.ArgumentParser = subparsers.add_parser(
            self.name, help=self.help, description=self.description, formatter_class=self.formatter_class
        )
        self.register_arguments(parser)
        parser.set_defaults(handler=self.execute)
        return parser

    @abstractmethod
    def register_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Declare the command's arguments; nothing else."""

    @abstractmethod
    def execute(self, args: argparse.Namespace) -> int:
        """Do the command with the parsed arguments; the exit status."""


class Group(ABC):
    """A command whose actions are commands of their own (`cluster-config`, `fleet`, `node-revision`)."""

    name: ClassVar[str]
    help: ClassVar[str]
    description: ClassVar[str | None] = None
    dest: ClassVar[str]
    metavar: ClassVar[str] = "ACTION"
    commands: ClassVar[tuple[type[Command | Group], ...]]

    def add_to(self, subparsers: Any) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = subparsers.add_parser(
            self.name, help=self.help, description=self.description
        )
        actions = parser.add_subparsers(dest=self.dest, required=True, metavar=self.metavar)
        for command in self.commands:
            command().add_to(actions)
        return parser


def register(subparsers: Any, commands: Sequence[type[Command | Group]]) -> None:
    """Add each command to the top parser's subparsers."""
    for command in commands:
        command().add_to(subparsers)
