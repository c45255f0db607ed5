"""The docs agree with the code: what a reader copies from them must be what the code does.

* The CLI synopsis in the README and in docs/design.md names every command, option and
  argument the parser (broker/cli.py, and tools/replay.py for ``replay``) accepts, with the
  same value names, and nothing else.
* A heading named in the code or the docs (``docs/design.md, "CLI"``) and a link's anchor
  (``docs/performance.md#the-replayed-workload``) exist.
* The README's precedence list names every environment variable a serve option is read from.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from kvcached_broker.broker.cli import build_parser
from kvcached_broker.tools.replay import build_parser as build_replay_parser

ROOT = Path(__file__).resolve().parents[1]


def fenced_block_after(path: Path, heading: str) -> str:
    """The first fenced code block after the line ``heading`` in ``path``."""
    text = path.read_text()
    start = text.index(f"\n{heading}\n")
    match = re.search(r"^```[^\n]*\n(.*?)^```", text[start:], re.S | re.M)
    assert match, f"{path.name}: no code block after {heading!r}"
    return match.group(1)


Usage = tuple[dict[str, "str | None"], list[str]]  # {--option: value name or None}, positional names


def synopsis(block: str) -> dict[str, Usage]:
    """``{command: ({--option: VALUE or None}, [POSITIONAL, ...])}`` from a synopsis block:
    lines ``kvcached-broker COMMAND ...`` with their continuation lines; ``[``, ``]``, ``|``
    and ``...`` are grammar, and a note in parentheses after two spaces is not part of it."""
    commands: dict[str, Usage] = {}
    current: str | None = None
    for line in block.splitlines():
        line = re.split(r"\s{2,}\(", line, maxsplit=1)[0]
        tokens = re.findall(r"[^\s\[\]]+", line)
        if tokens[:1] == ["kvcached-broker"]:
            current = tokens[1]
            assert current not in commands, f"{current} appears twice"
            commands[current] = ({}, [])
            tokens = tokens[2:]
        assert current is not None, f"a line before the first command: {line!r}"
        options, positionals = commands[current]
        words = [t for t in tokens if t not in ("|", "...")]
        i = 0
        while i < len(words):
            word = words[i]
            if word.startswith("--"):
                takes = i + 1 < len(words) and not words[i + 1].startswith("--")
                options[word] = words[i + 1] if takes else None
                i += 2 if takes else 1
            else:
                positionals.append(word)
                i += 1
    return commands


def parser_usage(parser: argparse.ArgumentParser) -> Usage:
    """What ``parser`` accepts, as :func:`synopsis` reads it from the docs (help and hidden
    options left out; a value's name is its metavar, else its dest in capitals)."""
    options: dict[str, str | None] = {}
    positionals: list[str] = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        name = action.metavar or action.dest.upper()
        if action.option_strings:
            (flag,) = [o for o in action.option_strings if o.startswith("--")]
            options[flag] = None if action.nargs == 0 else name
        else:
            positionals.append(name)
    return options, positionals


def the_parsers() -> dict[str, Usage]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    commands = {name: parser_usage(p) for name, p in sub.choices.items()}
    commands["replay"] = parser_usage(build_replay_parser())
    commands["--version"] = ({}, [])
    return commands


@pytest.mark.parametrize(("doc", "heading"), [("README.md", "## CLI"), ("docs/design.md", "### CLI")])
def test_the_cli_synopsis_is_the_parser(doc, heading):
    documented = synopsis(fenced_block_after(ROOT / doc, heading))
    actual = the_parsers()
    assert sorted(documented) == sorted(actual), f"{doc}: the commands differ from the parser's"
    for command, usage in actual.items():
        assert documented[command] == usage, f"{doc}: kvcached-broker {command}"


def test_the_synopsis_reader_sees_what_it_should():
    """The reader above on a small block: a wrong synopsis must not read as a right one."""
    block = ("kvcached-broker cmd ARG [--a N | --b] [--c SIZE|none] [--d X ...]  (a note, --not-an-option)\n"
             "                     [--e DIR]\n"
             "kvcached-broker --version\n")
    assert synopsis(block) == {"cmd": ({"--a": "N", "--b": None, "--c": "SIZE|none", "--d": "X", "--e": "DIR"}, ["ARG"]),
                               "--version": ({}, [])}


# ------------------------------------------------------------------ references to headings
SKIPPED_DIRS = {"build", "dist", "bench-results", "__pycache__", "node_modules"}
TEXT_SUFFIXES = {".py", ".md", ".sh", ".toml", ".yaml", ".yml", ".service", ".txt"}
#: ``docs/design.md, "CLI"``, ``README, "Using it from a worker"``, ``README's "Reliability"``,
#: ``README under "Security"``.
QUOTED_HEADING = re.compile(r"""((?:[\w.-]+/)*README(?:\.md)?|(?:[\w.-]+/)*[\w.-]+\.md)(?:'s)?,?(?: under)? "([^"\n]+)\"""")
#: ``[text](docs/performance.md#the-replayed-workload)``, ``[text](#environment)``.
LINK_ANCHOR = re.compile(r"\]\(([^)\s#]*)#([^)\s]+)\)")


def project_files() -> list[Path]:
    """The repository's own text files: no hidden folders (venvs, overlays), no build output."""
    found = []
    for folder, dirs, files in __import__("os").walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in SKIPPED_DIRS and not d.endswith(".egg-info")]
        found += [Path(folder, f) for f in files if Path(f).suffix in TEXT_SUFFIXES or f in ("Makefile", "Dockerfile")]
    return sorted(found)


def headings(path: Path) -> list[str]:
    """The Markdown headings of ``path`` (outside code blocks), backticks removed."""
    found, fenced = [], False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.+)", line)):
            found.append(m.group(1).strip().replace("`", ""))
    return found


def anchors(path: Path) -> set[str]:
    """GitHub's anchors for the headings of ``path`` (lower case, punctuation but ``-`` and
    ``_`` dropped, spaces to ``-``; a repeated one gets ``-1``, ``-2``, ...)."""
    seen: dict[str, int] = {}
    found = set()
    for heading in headings(path):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return found


def referenced(source: Path, target: str, bases: tuple[Path, ...] = ()) -> Path:
    """The file ``target`` names from ``source``: a path from the repository root, as the code
    and the docs quote them (``README`` is ``README.md``), or else from ``source``'s folder."""
    name = "README.md" if target.split("/")[-1] == "README" else target.split("/")[-1]
    target = "/".join([*target.split("/")[:-1], name])
    for base in bases or (ROOT, source.parent):
        if (base / target).is_file():
            return base / target
    raise AssertionError(f"{source.relative_to(ROOT)} refers to {target}, which does not exist")


def test_every_quoted_heading_reference_names_a_heading():
    """``(docs/design.md, "CLI")`` in a docstring or a document sends the reader to a heading
    that must exist (the heading as written, or its part before a parenthesis)."""
    checked, missing = 0, []
    for source in project_files():
        for m in QUOTED_HEADING.finditer(source.read_text(errors="replace")):
            target = referenced(source, m.group(1))
            quote = m.group(2).replace("`", "")
            checked += 1
            if not any(h == quote or h.startswith(quote + " (") for h in headings(target)):
                missing.append(f'{source.relative_to(ROOT)}: {m.group(1)}, "{m.group(2)}"')
    assert checked >= 10 and missing == []


def test_every_link_to_a_heading_finds_it():
    checked, missing = 0, []
    for source in project_files():
        if source.suffix != ".md":
            continue
        for m in LINK_ANCHOR.finditer(source.read_text()):
            if m.group(1).startswith(("http://", "https://")):
                continue
            target = referenced(source, m.group(1), (source.parent,)) if m.group(1) else source  # as Markdown does
            checked += 1
            if m.group(2) not in anchors(target):
                missing.append(f"{source.relative_to(ROOT)}: ({m.group(1)}#{m.group(2)})")
    assert checked >= 5 and missing == []


# ------------------------------------------------------------------ the serve options' variables
def test_every_variable_serve_reads_is_in_the_readmes_precedence_list():
    """The README's "Config file" section lists the environment variables a serve option is
    read from (``KVCACHED_BROKER_DEVICE``, then ``_SIMULATE`` for ``KVCACHED_BROKER_SIMULATE``...),
    and where the endpoint comes from: exactly those broker/config.py reads."""
    from kvcached_broker.broker.config import OPTIONS

    text = (ROOT / "README.md").read_text()
    listed = re.search(r"Precedence is: command line, then environment \((.*?)\),\s+then the file", text, re.S)
    assert listed, "README: no precedence list"
    names = {n if n.startswith("KVCACHED_") else "KVCACHED_BROKER" + n for n in re.findall(r"`([A-Z_]+)`", listed.group(1))}
    read = {variable for _, variable, _ in OPTIONS.values() if variable} | {"KVCACHED_BROKER"}
    assert names == read
