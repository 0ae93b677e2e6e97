"""The fenced code blocks of README.md and docs/*.md, and what each one is.

Blocks are found with Sybil's Markdown fence lexer. A block is *marked* when the
line right before its opening fence is ``<!-- not run: <one-line reason> -->``;
every other block must be one of the kinds below (tests/docs/test_blocks.py fails
on any block that is neither):

=========  ================================================================
python     executed in the page's Python session (blocks of a page share it, in order)
file       ``python``/``ini``/``toml`` whose first line is ``# <path>``: saved to <path>
append     first line ``# <path>: add ...``: appended to <path>
bash       each command run in the page's directory (``celery ... worker`` in the background)
console    each ``$ command`` run; the lines under it are the expected output
sql        run with psql on the page's database
=========  ================================================================
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from sybil import Document
from sybil.parsers.markdown.lexers import RawFencedCodeBlockLexer

REPO = Path(__file__).resolve().parents[2]

MARKER = re.compile(r"^[ \t]*<!-- not run: (?P<reason>.*?) -->[ \t]*$")
_HEADING = re.compile(r"^#{1,6} (?P<title>.+)$", re.M)
_FILE_HEADER = re.compile(
    r"^# (?P<path>[A-Za-z0-9_][A-Za-z0-9_./-]*\.(?:py|ini|cfg|toml))(?P<append>: add\b)?"
)
_LEXER = RawFencedCodeBlockLexer(
    info_pattern=re.compile(r"(?P<language>[^\n`]*)$\n", re.M),
    mapping={"language": "language", "source": "source"},
)

#: Languages whose blocks run (a ``python``/``ini``/``toml`` file block needs its header).
RUN_LANGUAGES = {
    "python": "python",
    "bash": "bash",
    "shell": "bash",
    "sh": "bash",
    "console": "console",
    "sql": "sql",
}


def pages() -> list[Path]:
    """Every page whose blocks must run or be marked."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    start: int  # offsets of the whole block in the page's text
    end: int
    language: str
    source: str
    heading: str  # the nearest heading above it ("" at the top of the page)
    marker: str | None  # the not-run reason, None when the block is not marked

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"

    @property
    def file(self) -> tuple[str, bool] | None:
        """(path, append) when the block is a file to save."""
        if self.language not in ("python", "ini", "toml", "cfg"):
            return None
        m = _FILE_HEADER.match(self.source)
        return (m["path"], bool(m["append"])) if m else None

    @property
    def kind(self) -> str | None:
        """How the block runs (see the module doc), or None if it cannot."""
        file = self.file
        if file is not None:
            return "append" if file[1] else "file"
        return RUN_LANGUAGES.get(self.language)

    @property
    def body(self) -> str:
        """The block's text without its file header line."""
        if self.file is None:
            return self.source
        return self.source.split("\n", 1)[1] if "\n" in self.source else ""


def blocks(page: Path, text: str | None = None) -> list[Block]:
    """The page's fenced blocks, in order."""
    text = page.read_text() if text is None else text
    document = Document(text, str(page))
    lines = text.split("\n")
    found: list[Block] = []
    heading, outside = "", 0  # headings are read only outside blocks
    for region in sorted(_LEXER(document), key=lambda r: r.start):
        titles = [m["title"] for m in _HEADING.finditer(text, outside, region.start)]
        heading = titles[-1].strip() if titles else heading
        outside = region.end
        line = text.count("\n", 0, region.start) + 1
        marked = MARKER.match(lines[line - 2]) if line >= 2 else None
        found.append(
            Block(
                page=page,
                line=line,
                start=region.start,
                end=region.end,
                language=str(region.lexemes["language"]).strip(),
                source=str(region.lexemes["source"]),
                heading=heading,
                marker=marked["reason"].strip() if marked else None,
            )
        )
    return found


def markers(page: Path) -> Iterator[tuple[int, str, bool]]:
    """Every not-run marker of the page: (line, reason, followed by a fence)."""
    lines = page.read_text().split("\n")
    for i, line in enumerate(lines):
        m = MARKER.match(line)
        if m:
            following = lines[i + 1] if i + 1 < len(lines) else ""
            yield i + 1, m["reason"].strip(), following.lstrip().startswith(("```", "~~~"))
