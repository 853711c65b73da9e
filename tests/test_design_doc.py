"""docs/DESIGN.md's module map (§8) names every module, and every name in it exists.

The map is the first fenced block after the heading "## <n>. Module map". Its grammar,
which the map's own preamble states: an entry is indented two spaces per open directory
(a name ending in "/" opens one, closed by the next line at its indentation or less);
a line indented deeper than that continues the description above it. An entry's first
word is a path relative to the open directory, or a glob. Modules: mp_offload/**/*.py
(a package's __init__.py only when it defines a function or class), csrc/*, tools/*.py,
bench/*.py, device_proof/*.py, scripts/*.sh.
"""

import ast
import glob
import os
import re

from helpers import ROOT

MODULE_GLOBS = (
    "mp_offload/**/*.py",
    "csrc/*",
    "tools/*.py",
    "bench/*.py",
    "device_proof/*.py",
    "scripts/*.sh",
)


def _map_lines(text: str) -> list[str]:
    heading = re.search(r"^## \d+\. Module map$", text, re.M)
    assert heading, "docs/DESIGN.md has no '## <n>. Module map' section"
    block = re.search(r"^```\n(.*?)^```$", text[heading.end() :], re.M | re.S)
    assert block, "the module map section has no fenced block"
    return block.group(1).splitlines()


def map_entries(text: str) -> list[str]:
    """The paths (or globs) the map names, relative to the repository root."""
    entries, open_dirs = [], []  # open_dirs: (indent, path ending in "/")
    for line in _map_lines(text):
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        while open_dirs and open_dirs[-1][0] >= indent:
            open_dirs.pop()
        if indent != 2 * len(open_dirs):
            continue  # deeper: the description above goes on
        name = open_dirs[-1][1] + line.split()[0] if open_dirs else line.split()[0]
        entries.append(name)
        if name.endswith("/"):
            open_dirs.append((indent, name))
    return entries


def _defines_something(path: str) -> bool:
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return any(isinstance(node, kinds) for node in tree.body)


def modules() -> set[str]:
    found = set()
    for pattern in MODULE_GLOBS:
        for path in glob.glob(os.path.join(ROOT, pattern), recursive=True):
            rel = os.path.relpath(path, ROOT)
            if "__pycache__" in rel or not os.path.isfile(path):
                continue
            if os.path.basename(rel) == "__init__.py" and not _defines_something(path):
                continue  # its directory's line describes the package
            found.add(rel)
    return found


def _design() -> str:
    with open(os.path.join(ROOT, "docs", "DESIGN.md"), encoding="utf-8") as f:
        return f.read()


def _matches(entry: str) -> list[str]:
    return glob.glob(os.path.join(ROOT, entry))


def test_every_module_is_in_the_map():
    entries = map_entries(_design())
    covered = {os.path.relpath(p, ROOT) for e in entries for p in _matches(e)}
    missing = sorted(modules() - covered)
    assert not missing, f"docs/DESIGN.md §8 module map lacks a line for: {', '.join(missing)}"


def test_every_name_in_the_map_exists():
    entries = map_entries(_design())
    assert len(entries) > 50, entries  # the grammar still recognises the map
    gone = [e for e in entries if not _matches(e)]
    assert not gone, f"docs/DESIGN.md §8 module map names what does not exist: {gone}"


def test_the_grammar():
    text = (
        "## 8. Module map\n\n```\n"
        "pkg/\n"
        "  a.py      one\n"
        "            a.py continued, not an entry\n"
        "  sub/\n"
        "    b.py    two\n"
        "  c/d.py    three\n"
        "top.sh      four\n"
        "```\n"
        "```\nnot/the_map.py\n```\n"
    )
    assert map_entries(text) == [
        "pkg/",
        "pkg/a.py",
        "pkg/sub/",
        "pkg/sub/b.py",
        "pkg/c/d.py",
        "top.sh",
    ]
