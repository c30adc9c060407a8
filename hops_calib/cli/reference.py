"""The CLI reference page (`docs/cli.md`), generated from the typer app so that it cannot drift from it:
`python -m hops_calib.cli.reference > docs/cli.md`. Every verb and sub-verb, in the app's order, with its usage
line, its help text and a table of its arguments and options as `--help` gives them (`tests/docs/test_docs.py` checks
that the committed page is this output)."""

from __future__ import annotations

from typing import Any

HEADER = """# CLI reference

What it is for: every `hops-calib` verb with its arguments and options, as `hops-calib VERB --help` gives them.
This page is generated from the typer app (`python -m hops_calib.cli.reference > docs/cli.md`); do not edit it
by hand (`tests/docs/test_docs.py` fails when it differs from the app). How the verbs fit together is in the topic
pages: [ingest](ingest.md), [simulator](simulator.md), [what-if and planning](whatif.md), [the loop](loop.md),
[research tools](research.md), [captures](captures.md).
"""


def _cell(text: str) -> str:
    """Text for a Markdown table cell: one line, pipes escaped, typer's markup escapes undone."""
    return " ".join(text.replace("\\[", "[").split()).replace("|", "\\|")


def _section(command: Any, context: Any, path: list[str]) -> list[str]:
    """The page's section of `command` (reached by `path` from the app), then those of its sub-verbs."""
    import typer._click as click

    lines: list[str] = []
    subcommands = getattr(command, "commands", None)
    if path:
        help_text = (command.help or "").replace("\\[", "[").strip()
        lines += [f"## `hops-calib {' '.join(path)}`", "", "```text", command.get_usage(context), "```", ""]
        if help_text:
            lines += [help_text, ""]
        rows = [
            record
            for param in command.get_params(context)
            if param.name != "help"
            for record in [param.get_help_record(context)]
            if record is not None
        ]
        if rows:
            lines += ["| argument or option | what |", "|---|---|"]
            lines += [f"| `{_cell(name)}` | {_cell(text)} |" for name, text in rows]
            lines.append("")
    for name, sub in (subcommands or {}).items():
        if sub.hidden:
            continue
        lines += _section(sub, click.Context(sub, info_name=name, parent=context), [*path, name])
    return lines


def reference() -> str:
    """The whole page, Markdown."""
    import typer._click as click
    import typer.main

    from hops_calib.cli import app

    root = typer.main.get_command(app)
    context = click.Context(root, info_name="hops-calib", terminal_width=120, max_content_width=120)
    return HEADER + "\n" + "\n".join(_section(root, context, [])).rstrip() + "\n"


if __name__ == "__main__":
    import sys

    sys.stdout.write(reference())
