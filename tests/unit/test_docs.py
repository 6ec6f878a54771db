"""The README stays a first visit: short, every preset named, and its links into docs/ lead somewhere; the
files and scripts the README and the docs/ pages name exist (MkDocs checks the links between pages)."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text(encoding="utf-8")
LINK = re.compile(r"\]\(([^)\s]+)\)")
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
# a path of the repository in code (`benchmarks/results/plan.md`, `src/kiln/configs/`), or a benchmark run as
# `python benchmarks/x.py` or `python -m benchmarks.x`
REPO_PATH = re.compile(r"`((?:benchmarks|src|tests|scripts|docs)/[^`\s*]*)`")
SCRIPT = re.compile(r"python3? (?:-m (benchmarks(?:\.\w+)+)|(benchmarks/[\w/]+\.py))")


def test_the_readme_is_under_250_lines():
    lines = len(README.splitlines())
    assert lines < 250, f"README.md has {lines} lines: move the new material into its page in docs/"


def test_every_preset_is_named():
    presets = sorted(p.stem for p in (REPO / "src" / "kiln" / "configs").glob("*.yaml"))
    assert len(presets) >= 6
    missing = [p for p in presets if f"`{p}`" not in README]
    assert not missing, f"presets the README does not name: {missing}"


def _anchors(page: Path) -> set[str]:
    """The ids MkDocs and GitHub give a page's headings (lower case, code and punctuation dropped, spaces to -)."""
    out = set()
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            text = line.lstrip("#").strip().replace("`", "").lower()
            out.add(re.sub(r"\s+", "-", re.sub(r"[^\w\s-]", "", text)).strip("-"))
    return out


def test_relative_links_lead_to_files_and_headings():
    links = [t for t in LINK.findall(README) if not re.match(r"[a-z]+://", t)]
    assert any(t.startswith("docs/") for t in links)
    broken = []
    for target in links:
        path, _, anchor = target.partition("#")
        file = REPO / path
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and anchor not in _anchors(file):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, "README links:\n" + "\n".join(broken)


def test_the_paths_and_scripts_the_pages_name_exist():
    missing = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for path in REPO_PATH.findall(text):
            path, _, test = path.partition("::")  # a test id: its file, and the test in it
            if not (REPO / path).exists() or (test and f"def {test.split('[')[0]}(" not in (REPO / path).read_text()):
                missing.append(f"{page.relative_to(REPO)}: {path}{'::' + test if test else ''}")
        for module, script in SCRIPT.findall(text):
            path = script or module.replace(".", "/") + ".py"
            if not (REPO / path).exists() and not (REPO / module.replace(".", "/")).is_dir():
                missing.append(f"{page.relative_to(REPO)}: python {'-m ' + module if module else script}")
    assert len(PAGES) > 10
    assert not missing, "named in the docs, not in the repository:\n" + "\n".join(missing)


def test_lists_tables_and_code_blocks_start_where_mkdocs_sees_them():
    """MkDocs' Markdown (Python-Markdown) reads a list or a table that follows a line of text without a blank
    line as more of that text, and a code fence indented under a list item as text: both pass `mkdocs build
    --strict` and render wrong on the site, though GitHub shows them right."""
    found = []
    for page in PAGES[1:]:
        lines = page.read_text(encoding="utf-8").splitlines()
        fenced = False
        for i, line in enumerate(lines):
            if line.lstrip().startswith("```"):
                if line.startswith(" "):
                    found.append(f"{page.relative_to(REPO)}:{i + 1}: a code fence inside a list item")
                fenced = not fenced
                continue
            starts = line.startswith(("- ", "| ", "* ")) or re.match(r"\d+\. ", line)
            before = lines[i - 1] if i else ""
            if not fenced and starts and before.strip() and not before.startswith(("- ", "* ", "| ", "  ")) \
                    and not re.match(r"\d+\. ", before):
                found.append(f"{page.relative_to(REPO)}:{i + 1}: no blank line before this list or table")
    assert not found, "\n".join(found)


def test_the_results_page_names_every_results_page():
    results = (REPO / "docs" / "results.md").read_text(encoding="utf-8")
    pages = sorted((REPO / "benchmarks" / "results").glob("*.md"))
    assert pages
    missing = [p.name for p in pages if f"`benchmarks/results/{p.name}`" not in results]
    assert not missing, f"docs/results.md: give the headline of {missing} (a row with the page's path)"
