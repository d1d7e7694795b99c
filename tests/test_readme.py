"""The README stays a front door: short, its architecture diagram names code that exists,
and its links and the docs' links lead somewhere."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
# Links allowed to point at a file this branch does not have yet.
PENDING_LINKS = {
    DOCS / "testing.md",  # written on the tests-tiers branch
}

_CLASS_METHOD = re.compile(r"\b([A-Z]\w*)\.([A-Za-z_]\w*)")
_CLASS_NAME = re.compile(r"(?<![\w.])([A-Z]\w*)\b")
_FUNCTION_CALL = re.compile(r"(?<![\w.])([a-z_]\w*)\(\)")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def architecture_block(markdown: str) -> str:
    """The fenced code block right under the '## Architecture' heading."""
    match = re.search(r"^## Architecture\s*\n+```[^\n]*\n(.*?)^```", markdown,
                      re.MULTILINE | re.DOTALL)
    assert match, "README.md has no fenced code block right under '## Architecture'"
    return match.group(1)


def diagram_names(block: str) -> tuple[set[tuple[str, str]], set[str], set[str]]:
    """(Class.method pairs, bare class names, function() names) the diagram mentions.
    A bare name is a capitalised identifier with a lower-case letter (WAITING, CUDA and
    K/V are words, not classes)."""
    pairs = set(_CLASS_METHOD.findall(block))
    owners = {cls for cls, _ in pairs}
    bare = {name for name in _CLASS_NAME.findall(block)
            if any(c.islower() for c in name) and name not in owners}
    functions = set(_FUNCTION_CALL.findall(block))
    return pairs, bare, functions


def code_index() -> tuple[dict[str, set[str]], dict[str, set[str]], set[str]]:
    """From every file under pagedllm/: class name -> the names its body defines (methods,
    class attributes, self.attributes set in its methods), class name -> its base class
    names, and the top-level function names."""
    members: dict[str, set[str]] = {}
    bases: dict[str, set[str]] = {}
    functions: set[str] = set()
    for path in sorted((ROOT / "pagedllm").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions.add(node.name)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                members.setdefault(node.name, set()).update(_class_members(node))
                bases.setdefault(node.name, set()).update(
                    b.id if isinstance(b, ast.Name) else b.attr
                    for b in node.bases if isinstance(b, (ast.Name, ast.Attribute)))
    return members, bases, functions


def _class_members(cls: ast.ClassDef) -> set[str]:
    names = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    for node in ast.walk(cls):
        if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name) and node.value.id == "self"):
            names.add(node.attr)
    return names


def has_member(cls: str, name: str, members: dict[str, set[str]],
               bases: dict[str, set[str]]) -> bool:
    """Whether cls or one of its bases defined under pagedllm/ defines name."""
    seen: set[str] = set()
    todo = [cls]
    while todo:
        c = todo.pop()
        if c in seen or c not in members:
            continue
        seen.add(c)
        if name in members[c]:
            return True
        todo.extend(bases.get(c, ()))
    return False


def test_architecture_diagram_names_exist_in_the_code() -> None:
    pairs, bare, functions = diagram_names(architecture_block(README.read_text()))
    assert pairs, "the architecture diagram names no Class.method"
    members, bases, top_level = code_index()
    missing = sorted(
        [f"{cls}.{name}" for cls, name in pairs if not has_member(cls, name, members, bases)]
        + [cls for cls in bare if cls not in members]
        + [f"{fn}()" for fn in functions if fn not in top_level])
    assert not missing, ("README.md's architecture diagram names what no file under "
                         f"pagedllm/ defines: {', '.join(missing)}")


def test_readme_is_under_250_lines() -> None:
    lines = README.read_text().count("\n")
    assert lines < 250, f"README.md has {lines} lines; move detail into docs/"


def heading_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a page's headings (lower case, punctuation dropped, spaces
    to hyphens); headings inside fenced code blocks are not headings."""
    anchors, fenced = set(), False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            text = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return anchors


def test_relative_links_lead_to_files_and_headings() -> None:
    broken = []
    for page in [README, *sorted(DOCS.glob("*.md"))]:
        for target in _LINK.findall(page.read_text()):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):
                continue  # a URL
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            if not path.exists():
                if path not in PENDING_LINKS:
                    broken.append(f"{page.relative_to(ROOT)} -> {target}")
            elif anchor and path.suffix == ".md" and anchor not in heading_anchors(path.read_text()):
                broken.append(f"{page.relative_to(ROOT)} -> {target} (no such heading)")
    assert not broken, f"links to missing files or headings: {', '.join(broken)}"


def test_docs_index_links_every_page() -> None:
    index = (DOCS / "README.md").read_text()
    linked = {(DOCS / t.split("#", 1)[0]).resolve() for t in _LINK.findall(index)}
    unlinked = [p.name for p in sorted(DOCS.glob("*.md"))
                if p.name != "README.md" and p.resolve() not in linked]
    assert not unlinked, f"docs/README.md does not link {', '.join(unlinked)}"
