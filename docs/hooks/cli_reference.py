"""The CLI reference of the docs site, generated from the `dpprobe` argparse parser.

`cli_markdown()` renders every subcommand of the parser that `dpprobe` itself runs: its usage
line, its help texts, and one row per option (flags and metavar as `--help` shows them, the
help text, the choices, the default and the options it excludes). The docs page
`reference/cli.md` holds the marker `<!-- cli-reference -->`, which the MkDocs hook
`on_page_markdown` below replaces at build time, so the reference cannot drift from `--help`.
`tests/pipelines/test_docs_cli.py` checks the same function against every subcommand's `--help`.

The one line that names where the parser lives is the import in `cli_markdown`.
"""

from __future__ import annotations

import argparse
import dataclasses
import re

MARKER = "<!-- cli-reference -->"
PAGE = "reference/cli.md"
USAGE_WIDTH = 96  # usage lines wrapped as a 96-column terminal would, whatever the build's


def cli_markdown() -> str:
    """The reference of every `dpprobe` subcommand, as Markdown."""
    from dpprobe.pipelines.cli import build_parser  # the one import of the CLI (see the docstring)

    return render_parser(build_parser())


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Each subcommand's parser by name, in the order `--help` lists them."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def render_parser(parser: argparse.ArgumentParser) -> str:
    """The program's own options and its commands, then every subcommand of `parser` as a
    Markdown section (`## \\`prog NAME\\``)."""
    sections = [render_program(parser)]
    sections += [render_command(sub) for sub in subcommands(parser).values()]
    return "\n\n".join(sections) + "\n"


def render_program(parser: argparse.ArgumentParser) -> str:
    """The top level: `prog COMMAND`, the commands with their one-line help, its options."""
    lines = [f"## `{parser.prog}`", ""]
    if parser.description:
        lines += [_escape(parser.description), ""]
    lines += ["| command | what it does |", "| --- | --- |"]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                lines.append(f"| [`{parser.prog} {choice.dest}`](#{parser.prog}-{choice.dest}) "
                             f"| {_escape(choice.help or '')} |")
    lines += ["", "| option | what it does | default |", "| --- | --- | --- |"]
    for action in parser._actions:
        if action.option_strings and action.help != argparse.SUPPRESS:
            lines.append(_row(action, {}, []))
    if parser.epilog:
        lines += ["", _escape(parser.epilog)]
    return "\n".join(lines)


def render_command(parser: argparse.ArgumentParser) -> str:
    """One subcommand: heading, description, usage, the options table, the epilog."""
    config_class = parser.get_default("config_class")
    defaults = _field_defaults(config_class)
    excludes = _exclusions(parser)
    formatter = argparse.HelpFormatter(parser.prog, width=USAGE_WIDTH)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups,
                        prefix="")
    lines = [f"## `{parser.prog}`", ""]
    if parser.description:
        lines += [_escape(parser.description), ""]
    lines += ["```text", formatter.format_help().strip(), "```", ""]
    lines += ["| option | what it does | default |", "| --- | --- | --- |"]
    for action in parser._actions:
        if action.help == argparse.SUPPRESS:
            continue
        lines.append(_row(action, defaults, excludes.get(action, [])))
    if parser.epilog:
        lines += ["", _escape(parser.epilog)]
    return "\n".join(lines)


def _row(action: argparse.Action, defaults: dict, excluded: list[str]) -> str:
    formatter = argparse.HelpFormatter("dpprobe")
    invocation = formatter._format_action_invocation(action)
    text = _escape(formatter._expand_help(action) if action.help else "")  # %(choices)s
    if text and not text.endswith("."):
        text += "."
    if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
        text += " Choices: " + ", ".join(f"`{c}`" for c in action.choices) + "."
    if excluded:
        text += " Excludes " + ", ".join(f"`{flag}`" for flag in excluded) + "."
    return f"| `{invocation}` | {text.strip()} | {_default(action, defaults)} |"


def _default(action: argparse.Action, defaults: dict) -> str:
    """The value an option not given takes: its config field's default (the parser's own
    defaults are suppressed so that the config's apply), or argparse's for an option that
    sets no field (`--json`, `--help`)."""
    if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
        return ""
    if action.required:
        return "required"
    if action.dest in defaults:
        value = defaults[action.dest]
        if value is dataclasses.MISSING:
            return "required"
        if isinstance(value, tuple) and hasattr(action, "end"):  # one end of a range field
            value = value[action.end]
        if action.nargs == 0 and value is not None:  # a switch: is it on when not given?
            value = value == action.const
    else:
        value = action.default
        if value is argparse.SUPPRESS:
            value = False if isinstance(action, argparse._StoreTrueAction) else None
    return _shown(value)


def _shown(value) -> str:
    if value is None:
        return ""  # chosen by the job: the help text says how
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return "`" + re.sub(r"e([+-])0", r"e\1", f"{value:g}") + "`"  # 1e-5, not 1e-05
    if isinstance(value, (list, tuple)):
        if not value:
            return ""
        return "`" + ",".join(_shown(v).strip("`") for v in value) + "`"
    return f"`{value}`"


def _field_defaults(config_class) -> dict:
    if config_class is None or not dataclasses.is_dataclass(config_class):
        return {}
    defaults = {}
    for field in dataclasses.fields(config_class):
        if field.default is not dataclasses.MISSING:
            defaults[field.name] = field.default
        elif field.default_factory is not dataclasses.MISSING:
            defaults[field.name] = field.default_factory()
        else:
            defaults[field.name] = dataclasses.MISSING
    return defaults


def _exclusions(parser: argparse.ArgumentParser) -> dict[argparse.Action, list[str]]:
    """For each option in a mutually exclusive group, the first flags of the others."""
    excludes: dict[argparse.Action, list[str]] = {}
    for group in parser._mutually_exclusive_groups:
        for action in group._group_actions:
            excludes[action] = [other.option_strings[0] for other in group._group_actions
                                if other is not action]
    return excludes


def _escape(text: str) -> str:
    """Help text as Markdown: one line; outside `code spans`, the characters Markdown would
    read as emphasis, table cells or HTML are escaped."""
    parts = re.split(r"(`[^`]*`)", " ".join(text.split()))
    return "".join(part if part.startswith("`") else _escape_prose(part) for part in parts)


def _escape_prose(text: str) -> str:
    text = re.sub(r"([\\*_|\[\]])", r"\\\1", text)  # Markdown's own escapes
    return text.replace("<", "&lt;").replace(">", "&gt;")  # Markdown does not escape these


# ---- The MkDocs hook (mkdocs.yml: `hooks: [docs/hooks/cli_reference.py]`) ---------------------


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise ValueError(f"{PAGE} lost its marker {MARKER}")
    return markdown.replace(MARKER, cli_markdown())
