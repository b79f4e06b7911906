"""Every design document the code, tests and docs point to is a file in this repository.

A comment such as "see docs/architecture.md, Rings" is only useful if a reader of the repository can open it, so
every ``docs/<name>.md`` mentioned anywhere must exist, every relative link between the docs must resolve (to a
heading, when it names one), and nothing may cite documents that live outside the repository.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

#: What is scanned: source, tests, docs, configuration.
SUFFIXES = {".py", ".pyi", ".md", ".toml", ".js", ".html", ".css", ".yml", ".yaml", ".c", ".cfg", ".txt"}
NAMES = {"Makefile", "Dockerfile", "run"}
SKIP_DIRS = {
    ".git",
    ".venv",
    ".venv-omni",
    ".venv-pipecat",
    "build",
    "dist",
    "test-output",
    "node_modules",
    "__pycache__",
}

DOC_REFERENCE = re.compile(r"\bdocs/([A-Za-z0-9_.-]+\.md)\b")
MARKDOWN_LINK = re.compile(r"\]\(([^)\s#]+\.md)?(#[^)\s]+)?\)")
#: Design notes that were never part of the repository (kept outside it while the project was designed). Their
#: names are assembled from parts so that this guard does not itself read as a citation of them.
_OUTSIDE_NOTES = [
    "-".join(parts)
    for parts in (
        ("openai", "live", "protocol"),
        ("openai", "realtime", "protocol"),
        ("cpu", "speech", "stack"),
        ("engine", "backends"),
        ("livekit", "duplex", "plugin"),
        ("browser", "webrtc", "testing"),
    )
]
_OUTSIDE_FOLDER = "/".join(("shared", "docs"))
OUTSIDE = re.compile(
    re.escape(_OUTSIDE_FOLDER) + r"|ARCHITECTURE(\.md|\s§)|(" + "|".join(_OUTSIDE_NOTES) + r")\.md"
)


def _files() -> list[Path]:
    out = []
    for path in sorted(ROOT.rglob("*")):
        rel = path.relative_to(ROOT)
        if any(part in SKIP_DIRS or part.endswith((".egg-info", "_cache")) for part in rel.parts[:-1]):
            continue
        if path.is_file() and (path.suffix in SUFFIXES or path.name in NAMES):
            out.append(path)
    return out


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(doc: Path) -> set[str]:
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+)$", doc.read_text(), re.MULTILINE)}


def test_every_referenced_doc_is_in_the_repository() -> None:
    files = _files()
    assert any(p.suffix == ".py" for p in files) and any(p.parent == DOCS for p in files)
    missing = []
    for path in files:
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for m in DOC_REFERENCE.finditer(line):
                if not (DOCS / m.group(1)).is_file():
                    missing.append(f"{path.relative_to(ROOT)}:{lineno}: docs/{m.group(1)}")
    assert not missing, "references to docs that are not in the repository:\n" + "\n".join(missing)


def test_links_between_docs_resolve_to_a_file_and_heading() -> None:
    broken = []
    for doc in sorted(DOCS.glob("*.md")):
        for m in MARKDOWN_LINK.finditer(doc.read_text()):
            name, anchor = m.group(1), m.group(2)
            if name is None and anchor is None:
                continue
            if name is not None and "://" in name:
                continue
            target = doc if name is None else (doc.parent / name)
            if not target.is_file():
                broken.append(f"{doc.name}: {m.group(0)} (no such file)")
            elif anchor is not None and anchor[1:] not in _anchors(target):
                broken.append(f"{doc.name}: {m.group(0)} (no such heading in {target.name})")
    assert not broken, "broken links between docs:\n" + "\n".join(broken)


def test_nothing_cites_documents_outside_the_repository() -> None:
    found = []
    for path in _files():
        if path == Path(__file__).resolve():
            continue
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                found.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()[:100]}")
    assert not found, "citations of documents outside the repository:\n" + "\n".join(found)


def test_the_checks_catch_what_they_look_for() -> None:
    """The patterns match the forms the code uses, so the tests above can fail."""
    assert DOC_REFERENCE.findall("see docs/architecture.md, Rings; docs/speech-stack.md") == [
        "architecture.md",
        "speech-stack.md",
    ]
    assert OUTSIDE.search(f"({_OUTSIDE_NOTES[2]}.md §0)") and OUTSIDE.search(f"see ../{_OUTSIDE_FOLDER}/x")
    assert OUTSIDE.search("ARCHITECTURE §6") and not OUTSIDE.search("docs/architecture.md")
    assert MARKDOWN_LINK.search("[a](development.md#structural-checks)").groups() == (
        "development.md",
        "#structural-checks",
    )
    assert (
        _slug("Tests that stand in for what cannot run here")
        == "tests-that-stand-in-for-what-cannot-run-here"
    )


def test_architecture_names_every_livekit_omni_subpackage() -> None:
    """docs/architecture.md describes the serving side as it is: every subpackage of livekit_omni is named there."""
    text = (DOCS / "architecture.md").read_text()
    packages = sorted(
        p.parent.relative_to(ROOT).as_posix() for p in (ROOT / "livekit_omni").glob("*/__init__.py")
    )
    assert packages, "no subpackage of livekit_omni was found"
    missing = [pkg for pkg in packages if f"`{pkg}/`" not in text]
    assert not missing, f"docs/architecture.md does not name {missing}"
