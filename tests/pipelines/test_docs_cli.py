"""The docs' CLI reference (docs/hooks/cli_reference.py) against the parser `dpprobe` runs:
every option that a subcommand's `--help` shows is in that subcommand's section, with its
choices and its default; and the renderer's rules on a small parser, by hand."""

import argparse
import dataclasses
import importlib.util
import pathlib
import re

import pytest

from dpprobe.pipelines.cli import build_parser

_HOOK = pathlib.Path(__file__).resolve().parents[2] / "docs" / "hooks" / "cli_reference.py"


def _load_hook():
    spec = importlib.util.spec_from_file_location("cli_reference", _HOOK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cli_reference = _load_hook()


@pytest.fixture(scope="module")
def reference() -> dict[str, str]:
    """The generated Markdown, cut into its sections by heading: {"dpprobe probe": ...}."""
    text = cli_reference.cli_markdown()
    sections = re.split(r"^## `([^`]+)`$", text, flags=re.MULTILINE)
    return dict(zip(sections[1::2], sections[2::2], strict=True))


def _help_options(parser: argparse.ArgumentParser) -> set[str]:
    """The flags `--help` prints in its options list (not its usage or prose)."""
    listing = parser.format_help().split("options:", 1)[1]
    invocations = [line.strip().split("  ")[0] for line in listing.splitlines()
                   if line.startswith("  -")]  # `  --flag METAVAR, -f METAVAR   help...`
    return {flag for text in invocations for flag in re.findall(r"(?:^|, )(-[-\w]+)", text)}


def test_every_subcommand_has_a_section(reference):
    parser = build_parser()
    names = list(cli_reference.subcommands(parser))
    assert names, "no subcommand found"
    assert list(reference) == ["dpprobe"] + [f"dpprobe {name}" for name in names]


def test_every_option_of_every_help_is_in_its_section(reference):
    parser = build_parser()
    for name, sub in cli_reference.subcommands(parser).items():
        section = reference[f"dpprobe {name}"]
        rows = [line for line in section.splitlines() if line.startswith("| `-")]
        documented = {flag for row in rows for flag in re.findall(r"(?<![\w-])(-[-\w]+)",
                                                                   row.split("|")[1])}
        shown = _help_options(sub)
        assert len(shown) >= 3, (name, shown)  # the parse of --help found its options
        assert shown <= documented, (name, sorted(shown - documented))
        for action in sub._actions:
            if not action.option_strings and action.dest != "help":  # a positional
                assert f"| `{action.metavar or action.dest}` |" in section, (name, action.dest)


def test_help_texts_choices_and_defaults_are_in_the_section(reference):
    parser = build_parser()
    for name, sub in cli_reference.subcommands(parser).items():
        section = reference[f"dpprobe {name}"]
        config_class = sub.get_default("config_class")
        defaults = {f.name: f.default for f in dataclasses.fields(config_class)}
        for action in sub._actions:
            if action.option_strings == ["-h", "--help"]:
                continue
            start = (f"| `{action.option_strings[0]}" if action.option_strings
                     else f"| `{action.metavar or action.dest}` |")
            row = next(line for line in section.splitlines() if line.startswith(start))
            first_words = " ".join((action.help or "").split()[:3])
            if "%(" not in first_words:
                assert cli_reference._escape(first_words) in row, (name, action.dest, row)
            for choice in action.choices or ():
                assert f"`{choice}`" in row, (name, action.dest, choice)
            default = defaults.get(action.dest, dataclasses.MISSING)
            if isinstance(default, int | float) and not isinstance(default, bool) \
                    and action.nargs != 0:
                assert f"`{default:g}`".replace("e-0", "e-") in row, (name, action.dest, row)


def test_probe_rows_by_hand(reference):
    section = reference["dpprobe probe"]
    assert "| `--delta DELTA` | target delta (default 1e-5). | `1e-5` |" in section
    assert "| `--epsilons EPSILONS` |" in section and "| `0.5,1,2,4,8` |" in section
    assert ("| `--sampling-probability SAMPLING_PROBABILITY, -q SAMPLING_PROBABILITY` |"
            in section)
    assert "Excludes `--in-memory`." in section and "Excludes `--stream`." in section
    assert "| `--quiet` | print only the table. | off |" in section
    assert "| `store` |" in section


def test_tune_range_ends_take_their_end_of_the_default(reference):
    section = reference["dpprobe tune"]
    assert re.search(r"^\| `--r-min R_RANGE` \|.*\| `1` \|$", section, re.MULTILINE)
    assert re.search(r"^\| `--r-max R_RANGE` \|.*\| `1000` \|$", section, re.MULTILINE)


@dataclasses.dataclass(frozen=True)
class _Config:
    store: str
    rate: float = 1e-05
    sizes: tuple = (3, 5)
    verbose: bool = True
    mode: str | None = None


def test_render_command_on_a_small_parser():
    parser = argparse.ArgumentParser(prog="tool run", argument_default=argparse.SUPPRESS,
                                     description="Does *one* thing with a_b | c.",
                                     epilog="See <here>.")
    parser.set_defaults(config_class=_Config)
    parser.add_argument("store", help="where `a_b` lives")
    parser.add_argument("--rate", type=float, help="the rate (default 1e-5)")
    parser.add_argument("--sizes", help="sizes, comma-separated")
    parser.add_argument("--quiet", dest="verbose", action="store_false", help="say less")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--mode", choices=["x", "y"], help="one of %(choices)s")
    group.add_argument("--auto", dest="mode", action="store_const", const="auto",
                       help="choose the mode")
    text = cli_reference.render_command(parser)
    rows = text.split("| --- | --- | --- |\n", 1)[1].split("\n\n")[0].splitlines()
    assert text.startswith("## `tool run`\n\nDoes \\*one\\* thing with a\\_b \\| c.\n")
    assert "```text\ntool run [-h] [--rate RATE] [--sizes SIZES] [--quiet] [--mode {x,y} |" \
           " --auto] store\n" in text
    assert rows == [
        "| `-h, --help` | show this help message and exit. |  |",
        "| `store` | where `a_b` lives. | required |",
        "| `--rate RATE` | the rate (default 1e-5). | `1e-5` |",
        "| `--sizes SIZES` | sizes, comma-separated. | `3,5` |",
        "| `--quiet` | say less. | off |",
        "| `--mode {x,y}` | one of x, y. Choices: `x`, `y`. Excludes `--auto`. |  |",
        "| `--auto` | choose the mode. Excludes `--mode`. |  |",
    ]
    assert text.endswith("\n\nSee &lt;here&gt;.")
