"""The documentation against the tree (fast: no Ray, no torch): docs/design.md's module map names every module
of the package and nothing that does not exist, the relative links of the Markdown pages point at files of the
repository, and BENCHMARKS.md's figures and result paths exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "cbserve"
DESIGN = ROOT / "docs" / "design.md"
BENCHMARKS = ROOT / "BENCHMARKS.md"
PAGES = [ROOT / "README.md", BENCHMARKS, *sorted((ROOT / "docs").glob("*.md"))]

_MAP_ENTRY = re.compile(r"^- `([^`]+)`:", re.MULTILINE)
_LINK = re.compile(r"(!?)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_RESULT_PATH = re.compile(r"benchmarks/results/[\w./-]*[\w/]")


def _section(text: str, title: str) -> str:
    """The body of the ``## title`` section of a Markdown page (up to the next level-2 heading)."""
    start = text.find(f"\n## {title}\n")
    assert start >= 0, f"no section '## {title}'"
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def _map_entries() -> list[str]:
    return _MAP_ENTRY.findall(_section(DESIGN.read_text(), "Module map"))


def _modules() -> set[str]:
    """Every module of the package (paths relative to cbserve/), package __init__ files left out."""
    return {
        p.relative_to(PACKAGE).as_posix()
        for p in PACKAGE.rglob("*.py")
        if p.name != "__init__.py" and "__pycache__" not in p.parts
    }


def test_module_map_names_every_module() -> None:
    missing = sorted(_modules() - set(_map_entries()))
    assert not missing, f"modules missing from docs/design.md's module map: {missing}"


def test_module_map_names_only_what_exists() -> None:
    entries = _map_entries()
    assert len(entries) > 50  # the parser found the map
    stale = [e for e in entries if not (PACKAGE / e).exists()]
    assert not stale, f"docs/design.md's module map names paths that do not exist under cbserve/: {stale}"
    twice = sorted({e for e in entries if entries.count(e) > 1})
    assert not twice, f"listed more than once: {twice}"


def _relative_links(page: Path) -> list[tuple[bool, str]]:
    """(is an image, target) of every link of ``page`` that is not a URL or an anchor within the page."""
    out = []
    for bang, target in _LINK.findall(page.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        out.append((bang == "!", target.split("#", 1)[0]))
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_point_at_files_of_the_repository(page: Path) -> None:
    bad = []
    for _, target in _relative_links(page):
        path = (page.parent / target).resolve()
        if not path.is_relative_to(ROOT) or not path.exists():
            bad.append(target)
    assert not bad, f"{page.name}: links to nothing in the repository: {bad}"


def test_benchmark_figures_exist() -> None:
    images = [target for is_image, target in _relative_links(BENCHMARKS) if is_image]
    assert images, "BENCHMARKS.md shows no figure"
    missing = [t for t in images if not (ROOT / t).is_file()]
    assert not missing, f"BENCHMARKS.md shows figures that do not exist: {missing}"


def test_benchmark_result_paths_exist() -> None:
    """Every benchmarks/results/ path BENCHMARKS.md names (figures, result files, --out-dir folders) exists."""
    missing = sorted({p for p in _RESULT_PATH.findall(BENCHMARKS.read_text()) if not (ROOT / p).exists()})
    assert not missing, f"BENCHMARKS.md names results that do not exist: {missing}"
