"""A verb split into sub-verbs by mode that still takes its old spelling: `DefaultVerbGroup` sends a command line
whose first word names no sub-verb (`plan --job DIR`, `predict ID`) to the group's hidden `LEGACY` command, which
reads the old options, so every old spelling keeps working beside the sub-verbs (`plan job DIR`, `predict run ID`)."""

from __future__ import annotations

from typing import Any

import typer._click as click
from typer.core import TyperCommand, TyperGroup

LEGACY = "legacy"  # the hidden command of the old spelling, in each group that has one


class _OldSpellingContext(click.Context):
    @property
    def command_path(self) -> str:
        return super().command_path.rstrip()


class OldSpelling(TyperCommand):
    """The hidden command of a group's old spelling: its usage and errors name the verb as typed (`plan
    [OPTIONS]`), without the hidden name."""

    context_class = _OldSpellingContext


class DefaultVerbGroup(TyperGroup):
    """A group whose unnamed command lines go to its hidden `LEGACY` command (the old spelling)."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ctx.help_option_names and LEGACY in self.commands:
            args = [LEGACY, *args]
        return super().parse_args(ctx, args)

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        name, command, rest = super().resolve_command(ctx, args)
        # the old spelling's usage and errors name the verb as it was typed (`plan [OPTIONS]`, not `plan legacy`)
        return ("" if name == LEGACY else name), command, rest
