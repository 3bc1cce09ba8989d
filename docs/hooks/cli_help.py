"""mkdocs hook: `<!-- cli: module.path -->` in a page becomes that module's `build_parser()` rendered as a flag
table plus the exact `--help` text, so the CLI pages are generated from the parsers and cannot drift."""

from __future__ import annotations

import argparse
import importlib
import os
import re

_MARKER = re.compile(r"<!--\s*cli:\s*([\w.]+)\s*-->")


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _flag_table(parser: argparse.ArgumentParser) -> str:
    rows = ["| flag | default | what it does |", "|---|---|---|"]
    for action in parser._actions:  # argparse keeps no public list of actions
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        flags = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.dest}`"
        if action.metavar is not None and action.nargs != 0:
            flags += f" `{action.metavar}`"
        elif action.choices is not None:
            flags += " `{" + ",".join(str(c) for c in action.choices) + "}`"
        if action.nargs == 0 or action.default in (None, argparse.SUPPRESS):
            default = ""
        else:
            default = f"`{action.default}`"
        help_text = (action.help or "") % {"default": action.default, "prog": parser.prog} if action.help else ""
        rows.append(f"| {flags} | {_escape(default)} | {_escape(help_text)} |")
    return "\n".join(rows)


def render(module: str) -> str:
    os.environ["COLUMNS"] = "100"  # argparse wraps --help to the terminal width: fix it for a stable page
    parser = importlib.import_module(module).build_parser()
    return (f"{_flag_table(parser)}\n\n`{parser.prog} --help`:\n\n```text\n{parser.format_help().rstrip()}\n```\n")


def on_page_markdown(markdown: str, **kwargs) -> str:
    return _MARKER.sub(lambda m: render(m.group(1)), markdown)
