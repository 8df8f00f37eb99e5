"""The CLI reference (docs/reference/cli.md), from an argparse parser.

Every command and subcommand, depth first: its usage line (at a fixed width), description,
arguments and subcommands. argparse has no public way to list a parser's arguments, so this
reads ``_actions`` and ``_choices_actions`` as its own help output does.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import Any

from scripts._markdown import HEADER, cell, one_of, text

__all__ = ["cli_markdown"]

WIDTH = 80  # usage lines are wrapped at this width, whatever the terminal
_INTRO = """\
Every command also takes `-h`/`--help`. The defaults shown are those with no `ROUTER_*`
environment variable set."""


class _FixedWidth(argparse.HelpFormatter):
    """Formats usage at ``WIDTH`` columns, not the terminal's."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, width=WIDTH)


def cli_markdown(parser: argparse.ArgumentParser) -> str:
    """The CLI reference: every command and subcommand of ``parser``."""
    lines = ["# CLI reference", "", HEADER.format(source="argparse parser of `router`"), ""]
    lines += [_INTRO, ""]
    for command, summary in _commands(parser, parser.description or ""):
        lines += _command_section(command, summary)
    return "\n".join(lines)


def _commands(
    parser: argparse.ArgumentParser, summary: str
) -> Iterator[tuple[argparse.ArgumentParser, str]]:
    """This parser and its description, then each subcommand's, depth first."""
    yield parser, parser.description or summary
    for action in _subcommands(parser):
        helps = {a.dest: a.help or "" for a in action._choices_actions}
        for name, command in action.choices.items():
            yield from _commands(command, helps.get(name, ""))


def _command_section(parser: argparse.ArgumentParser, summary: str) -> list[str]:
    parser.formatter_class = _FixedWidth
    usage = parser.format_usage().strip()
    lines = [f"## `{parser.prog}`", "", text(summary), "", "```text", usage, "```", ""]
    rows = [row for action in parser._actions if (row := _argument_row(action))]
    if rows:
        lines += ["| argument | value | default | description |", "| --- | --- | --- | --- |"]
        lines += ["| " + " | ".join(row) + " |" for row in rows] + [""]
    for action in _subcommands(parser):
        lines += ["| command | description |", "| --- | --- |"]
        lines += [
            f"| `{parser.prog} {a.dest}` | {cell(text(a.help))} |" for a in action._choices_actions
        ]
        lines.append("")
    return lines


def _argument_row(action: argparse.Action) -> tuple[str, str, str, str] | None:
    hidden = action.help == argparse.SUPPRESS
    if hidden or isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
        return None
    names = ", ".join(f"`{o}`" for o in action.option_strings)
    value = "" if action.nargs == 0 or not action.option_strings else _value(action)
    if isinstance(action, argparse._AppendAction):
        value += " (repeatable)"
    return (
        names or f"`{action.metavar or action.dest}`",
        cell(value),
        _cli_default(action),
        cell(text(action.help)),
    )


def _value(action: argparse.Action) -> str:
    if isinstance(action.metavar, str):
        shown = f"`{action.metavar}`"
    elif action.choices is not None:
        shown = one_of(list(action.choices))
    else:
        shown = f"`{action.dest.upper()}`"
    return f"[{shown}]" if action.nargs == "?" else shown


def _cli_default(action: argparse.Action) -> str:
    if action.required:
        return "required"
    if action.nargs == 0 or action.default in (None, [], argparse.SUPPRESS):
        return ""
    return f"`{cell(str(action.default))}`"


def _subcommands(parser: argparse.ArgumentParser) -> list[argparse._SubParsersAction[Any]]:
    return [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
