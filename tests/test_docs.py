"""The documentation holds together: every relative link resolves, to a file and, with #anchor, to a heading of
it; the README stays short and maps every concept to a file that exists."""

import re
from pathlib import Path

from tests.conftest import ROOT

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _pages() -> list[Path]:
    tracked = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md")),
               *sorted((ROOT / "benchmarks" / "results").glob("*/comparison.md")), ROOT / "c4" / "guide.md"]
    return [p for p in tracked if p.is_file()]


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens (outside code blocks)."""
    found, in_code = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and re.match(r"#{1,6} ", line):
            found.add(re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-"))
    return found


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    broken, in_code = [], False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
            continue
        for target in [] if in_code else LINK.findall(line):
            if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked here
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.relative_to(root)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                broken.append(f"{page.relative_to(root)}: {target} (no such heading)")
    return broken


def test_every_relative_link_resolves():
    pages = _pages()
    assert len(pages) >= 10 and (ROOT / "docs" / "configuration.md") in pages
    broken = [b for page in pages for b in broken_links(page)]
    assert not broken, broken


def test_the_link_check_finds_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[fine](#title) [gone](#nowhere) [missing](missing.md)\n```\n[in code](x.md)\n```\n")
    assert broken_links(page, tmp_path) == ["page.md: #nowhere (no such heading)", "page.md: missing.md (no such file)"]


def test_the_readme_is_short_and_maps_every_concept_to_a_file_that_exists():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 350
    section = readme[readme.index("## Where each concept lives"):readme.index("## The headline result")]
    named = re.findall(r"`([\w/.*]+\.(?:py|yaml|json|md)|[\w/]+/)`", section)
    assert len(named) >= 30
    for name in named:  # the files and folders of the repository it names (not a run's outputs)
        if name.endswith(".py") or "/" in name:
            assert list(ROOT.glob(name)), name
    for heading in ("## Contents", "## Quick start", "## What a run shows", "## Differences from the authors' code"):
        assert heading in readme, heading


def test_command_lines_in_the_tools_help_keep_their_continuations():
    """A backslash at the end of a docstring line is swallowed by Python unless escaped: the --help then shows a
    command with a gap in the middle instead of two lines."""
    import re

    import benchmarks.compare.options
    import benchmarks.tune
    import gradient_analysis.gradient_analysis

    for module in (benchmarks.compare.options, benchmarks.tune, gradient_analysis.gradient_analysis):
        for line in module.__doc__.splitlines():
            if line.lstrip().startswith("python -m"):
                assert not re.search(r"\S {5,}\S", line), (module.__name__, line)


def test_the_tools_help_examples_never_write_into_the_committed_results():
    """A command copied from --help must not overwrite a committed report (benchmarks/results/...)."""
    import benchmarks.compare.options
    import benchmarks.tune

    for module in (benchmarks.compare.options, benchmarks.tune):
        for line in module.__doc__.splitlines():
            assert "--out benchmarks/results" not in line, (module.__name__, line)


def test_licence_and_citation_exist_and_the_readme_names_them():
    import yaml

    licence = (ROOT / "LICENSE").read_text()
    assert "Apache License" in licence and "Version 2.0, January 2004" in licence and "END OF TERMS" in licence
    citation = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert citation["cff-version"] == "1.2.0" and citation["license"] == "Apache-2.0"
    paper = citation["preferred-citation"]
    assert paper["url"] == "https://arxiv.org/abs/2508.18182" and paper["authors"][0]["family-names"] == "Kutuzov"
    readme = (ROOT / "README.md").read_text()
    assert "[LICENSE](LICENSE)" in readme and "[CITATION.cff](CITATION.cff)" in readme


def test_the_console_transcript_has_one_copy():
    """The README holds the run's console lines; no other page keeps an older copy of them."""
    assert "[outer 12/12]" in (ROOT / "README.md").read_text()
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert "[outer 12/12]" not in page.read_text(), page.name
