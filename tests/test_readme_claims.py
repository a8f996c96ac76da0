"""README's checkable claims about the tree, its limits and its links: "Repository layout" names every source file,
each under its own folder's entry, and nothing that is not there; the drop-in table's limits are the code's; a
link to a heading of a repository file lands on one."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = {".py", ".cu", ".cuh", ".h", ".cpp", ".sh"}
FOLDERS = ("ep_layer", "serving", "csrc", "dropin", "benchmarks", "scripts")
NAME = re.compile(r"[\w.]+\.(?:py|cu|cuh|h|cpp|sh)\b")


def layout_block() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split("## Repository layout", 1)[1].split("```", 2)[1]
    return block.splitlines()


def entry(lines: list[str], name: str, indent: int) -> list[str]:
    """The lines of the entry `name/` at `indent` (itself and the lines below it, up to the next entry at that
    indent or less)."""
    head = " " * indent + name + "/"
    starts = [i for i, line in enumerate(lines) if line.startswith(head)]
    assert starts, f"README's layout has no entry {name}/"
    out = [lines[starts[0]]]
    for line in lines[starts[0] + 1:]:
        if len(line) - len(line.lstrip()) <= indent and line.strip():
            break
        out.append(line)
    return out


def section_of(path: Path) -> str:
    """The text of the deepest layout entry that holds `path` (a folder's own entry where it has one)."""
    lines = layout_block()
    parts = path.relative_to(ROOT).parts[:-1]
    section = entry(lines, parts[0], 0)
    if len(parts) > 1 and any(line.startswith(f"  {parts[1]}/") for line in section):
        section = entry(section, parts[1], 2)
    return "\n".join(section)


def sources() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*")
                  if p.suffix in SOURCE and p.name != "__init__.py" and "__pycache__" not in p.parts
                  and "build" not in p.relative_to(ROOT).parts)


def test_every_source_file_is_named_under_its_folder():
    missing = [str(p.relative_to(ROOT)) for p in sources() if not re.search(rf"\b{re.escape(p.name)}\b",
                                                                             section_of(p))]
    assert not missing, f"README's layout does not name: {missing}"


def test_every_file_the_layout_names_exists():
    names = {p.name for p in sources()} | {p.name for p in (ROOT / "tests").glob("*.py")} | {"__init__.py", "setup.py"}
    named = set(NAME.findall("\n".join(layout_block())))
    assert named - names == set(), f"README's layout names files that are not there: {sorted(named - names)}"


def test_the_limits_readme_states_are_the_codes():
    """The drop-in table's sizes and ranks rows against the constants the checks and kernels use."""
    from ep_layer.backends.cuda import MAX_HIDDEN
    from ep_layer.checks import MAX_TOKENS_PER_RANK
    from ep_layer.layout import MAX_EXPERTS, MAX_RANKS, MAX_TOPK

    rows = {line.split("|")[1].strip(): line for line in (ROOT / "README.md").read_text().splitlines()
            if line.startswith("| ") and line.count("|") == 4}
    assert f"up to {MAX_TOKENS_PER_RANK} tokens per rank, top-k up to {MAX_TOPK}, up to {MAX_EXPERTS} experts" \
        in rows["sizes"], rows["sizes"]
    assert f"up to {MAX_HIDDEN} on the cuda backend" in rows["hidden size"], rows["hidden size"]
    assert f"up to {MAX_RANKS}:" in rows["ranks"] and f"more than {MAX_RANKS} ranks" in rows["ranks"], rows["ranks"]


def github_anchor(heading: str) -> str:
    """The fragment GitHub gives a Markdown heading: lower case, punctuation other than - and _ dropped, spaces
    to -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_into_a_markdown_file_names_one_of_its_headings():
    """Links from README.md and docs/ to a heading of a repository file (`path.md#fragment`) land on one."""
    link = re.compile(r"\]\(([\w./-]+\.md)#([\w-]+)\)")
    for source in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target, fragment in link.findall(source.read_text()):
            path = (source.parent / target).resolve()
            headings = [line.lstrip("#") for line in path.read_text().splitlines() if line.startswith("#")]
            assert fragment in {github_anchor(h) for h in headings}, f"{source.name}: {target}#{fragment}"
