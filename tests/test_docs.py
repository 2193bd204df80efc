"""The documentation stays true to the tree: links resolve, named commands exist, the README stays short.

Pages checked: README.md, docs/*.md and bench/README.md. Every relative link ([text](path) or
[text](path#anchor)) must name a file or folder of the checkout, and an anchor a heading of the target
page (GitHub's anchor rule); every `make TARGET` in code must be a rule of the Makefile; every
`blockgen SUBCOMMAND` in code a subcommand of the command line's parser (read from the parser itself,
so a new or renamed subcommand needs no edit here); every module of models/, harness/, tasks/ has its
line in docs/layout.md; no page cites a path of the machine the docs were written on. Claims the code
can check: the table of grids (names, settings), the count of grids, the presets named in
docs/training.md; and the README keeps no dated figures (docs/results.md does).
"""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted([REPO / "README.md", REPO / "bench" / "README.md", *(REPO / "docs").glob("*.md")])
FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")


def _page_id(page: Path) -> str:
    return str(page.relative_to(REPO))


def _prose(text: str) -> str:
    """The text outside fenced code blocks (links and headings in code are not links or headings)."""
    return FENCE.sub("", text)


def _code(text: str) -> list[str]:
    """Every piece of code: fenced blocks line by line, and inline code spans of the prose."""
    pieces = [line for block in FENCE.finditer(text) for line in block.group(0).splitlines()]
    return pieces + CODE_SPAN.findall(_prose(text))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, each space a hyphen."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in _prose(page.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def test_the_pages_exist_and_the_readme_is_short():
    assert (REPO / "README.md").is_file()
    docs = sorted((REPO / "docs").glob("*.md"))
    assert len(docs) >= 5, [p.name for p in docs]
    lines = (REPO / "README.md").read_text().count("\n")
    assert lines <= 250, f"README.md has {lines} lines; the reference goes into docs/"


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_relative_links_resolve(page: Path):
    broken = []
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif REPO not in dest.parents and dest != REPO:
            broken.append(f"{target}: outside the repository")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.relative_to(REPO)}")
    assert not broken, f"{_page_id(page)}: " + "; ".join(broken)


def makefile_targets() -> set[str]:
    targets: set[str] = set()
    for line in (REPO / "Makefile").read_text().splitlines():
        # a rule `a b: prerequisites`, not a variable (`X := ...`, `X ?= ...`) nor a recipe line
        m = re.match(r"^([A-Za-z0-9_.%/$()-][^:=#\t]*?)\s*::?(?!=)", line)
        if m:
            targets.update(m.group(1).split())
    return targets


def make_targets_named(text: str) -> set[str]:
    """Targets of every `make ...` in code: words after `make`, skipping options and VAR=value."""
    named: set[str] = set()
    for piece in _code(text):
        for m in re.finditer(r"(?:^|[\s;(&|$])make((?:\s+\S+)+)", piece):
            for word in m.group(1).split():
                if word.startswith("-") or "=" in word:
                    continue
                if not re.fullmatch(r"[a-z][a-z0-9-]*", word):
                    break
                named.add(word)
    return named


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_make_targets_exist(page: Path):
    missing = make_targets_named(page.read_text()) - makefile_targets()
    assert not missing, f"{_page_id(page)} names make targets the Makefile lacks: {sorted(missing)}"


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser] | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return None


def blockgen_commands_named(text: str) -> set[tuple[str, ...]]:
    """(subcommand, next word) of every `blockgen X Y` / `-m blockgen.harness.cli X Y` in code."""
    named: set[tuple[str, ...]] = set()
    for piece in _code(text):
        for m in re.finditer(r"(?:^|[\s;(&|$])(?:blockgen|-m\s+blockgen\.harness\.cli)\s+([a-z][\w-]*)(?:\s+([a-z][\w-]*)\b(?![./:]))?", piece):
            named.add((m.group(1), m.group(2)) if m.group(2) else (m.group(1),))
    return named


def test_blockgen_subcommands_exist():
    from blockgen.harness.cli import build_parser

    top = _subcommands(build_parser())
    assert top, "the blockgen parser has no subcommands"
    wrong = []
    for page in PAGES:
        for named in sorted(blockgen_commands_named(page.read_text())):
            if named[0] not in top:
                wrong.append(f"{_page_id(page)}: blockgen {named[0]} (subcommands: {', '.join(sorted(top))})")
                continue
            nested = _subcommands(top[named[0]])
            # a subcommand with subcommands of its own: the next word must be one (else it is an argument)
            if nested and len(named) > 1 and named[1] not in nested:
                wrong.append(f"{_page_id(page)}: blockgen {' '.join(named)} (choices: {', '.join(sorted(nested))})")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_no_machine_paths(page: Path):
    hits = re.findall(r"(?<![\w.~-])/(?:work|tmp|home|root)/\S*", page.read_text())
    assert not hits, f"{_page_id(page)} cites paths of one machine: {hits}"


def test_every_module_has_a_line_in_the_layout_page():
    layout = (REPO / "docs" / "layout.md").read_text()
    modules = [p for folder in ("models", "harness", "tasks") for p in sorted((REPO / folder).rglob("*.py"))
               if p.name != "__init__.py"]
    wings = sorted({p.parent for p in (REPO / "harness").rglob("*.py")} - {REPO / "harness"})
    assert len(wings) >= 5, wings  # not vacuous: the wings are found
    named = [f"`{p.relative_to(REPO)}`" for p in modules] + [f"`{w.relative_to(REPO)}/`" for w in wings]
    missing = [n for n in named if n not in layout]
    assert not missing, f"docs/layout.md has no line for {missing}"
    for wing in wings:  # each wing says in one paragraph what it holds
        doc = ast.get_docstring(ast.parse((wing / "__init__.py").read_text()))
        assert doc and "\n\n" not in doc.strip(), f"{wing.relative_to(REPO)}/__init__.py: one paragraph"


def test_the_grid_table_lists_every_grid_with_its_settings():
    """docs/pipeline.md's table of grids: one row per grid of the registry, each with its number of
    settings (what `blockgen sweep GRID --dry-run` lists); a count of grids in any page is theirs."""
    from blockgen.harness.evaluation.grids import GRIDS
    from blockgen.harness.evaluation.evaluations import evaluations

    rows = re.findall(r"^\| `([\w-]+)` \|.*\| (\d+) \|$", (REPO / "docs" / "pipeline.md").read_text(), re.M)
    assert {name: int(n) for name, n in rows} == {name: len(evaluations(g, "/nonexistent")) for name, g in GRIDS.items()}
    for page in PAGES:
        for n in re.findall(r"\b(\d+) (?:evaluation )?grids\b", page.read_text()):
            assert int(n) == len(GRIDS), f"{_page_id(page)} speaks of {n} grids; harness/evaluation/grids.py has {len(GRIDS)}"


def test_the_training_page_names_every_preset():
    """docs/training.md's tables name every variant of the paper's presets (`<benchmark>-<variant>`;
    `masked-4/8/16` names three) and every other preset."""
    from blockgen.harness.training.presets import BENCHMARKS, PRESETS, VARIANTS

    named = set()
    for code in CODE_SPAN.findall((REPO / "docs" / "training.md").read_text()):
        stem, sizes = re.fullmatch(r"(.*?)(?:-([\d/]+))?", code).groups()
        named |= {f"{stem}-{n}" for n in sizes.split("/")} if sizes else {code}
    assert not set(VARIANTS) - named, f"docs/training.md names no variant {sorted(set(VARIANTS) - named)}"
    paper = {f"{bench}-{v}" for bench, (_, variants) in BENCHMARKS.items() for v in variants}
    missing = [name for name in PRESETS if name not in paper | named]
    assert not missing, f"docs/training.md names no preset {missing}"


def test_the_readme_keeps_no_dated_figures():
    """Dates, test counts and timings of one run go stale: they live in docs/results.md, the README links there."""
    text = LINK.sub("", (REPO / "README.md").read_text())  # link targets may name a dated heading
    dated = re.findall(r"\b20\d\d-\d\d-\d\d\b|\b\d+ tests\b|\b\d+ min(?: \d+ s)?\b", text)
    assert not dated, f"README.md has dated figures {dated}; keep them in docs/results.md"


def test_the_checks_catch_what_they_claim_to(tmp_path: Path):
    """The parsers above, on text written to fail: a dead link, a missing anchor, an unknown target."""
    (tmp_path / "a.md").write_text("# Title `x`\n\n## The paper's A - B\n\n```\n# not a heading\n```\n")
    assert anchors(tmp_path / "a.md") == {"title-x", "the-papers-a---b"}
    text = "`make demo OFFLINE=1 test` and `make -n eval-owt NGPU=8 / nope`\n```\nmake train-owt eval-owt X=1\n```\n"
    assert make_targets_named(text) == {"demo", "test", "eval-owt", "train-owt"}
    assert make_targets_named("we make sure") == set()
    text = "`blockgen train --preset x`, `torchrun -m blockgen.harness.cli sweep owt`, `blockgen leaderboard compare A B`"
    assert blockgen_commands_named(text) == {("train",), ("sweep", "owt"), ("leaderboard", "compare")}
    assert blockgen_commands_named("`--model blockgen --tasks x`, `blockgen.harness.training.train`, `hf:jdeschena/blockgen/ar`") == set()
    assert "no-such-target" not in makefile_targets() and {"demo", "test", "help"} <= makefile_targets()
