"""The code and its documents describe what the code does and why, never its history: no issue numbers, no
numbered work sessions, no past habits of the code. A counting allocator's session is legitimate runtime
vocabulary and is not matched: only the word followed by a number is. The samples below are the patterns'
own test data (this file is not searched)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("adaptive_mem", "profiler", "search", "tests", "docs", "benchmarks")
SUFFIXES = {".py", ".md", ".cpp", ".yaml", ".yml", ".txt", ".toml"}

# Note: [house history words] each pattern names history, not code:
# - a hash and one or two digits: an issue number; a hex colour or a markdown anchor is no match;
# - the word issue with a number (a space, hyphen or hash between): an issue number;
# - the word session with a number: a work session (an allocator's session takes no number);
# - the past habit "used to <verb>"; the passive after a form of "be" ("is used to store") is no match, so
#   write a passive with its verb ("the bytes that are used to store it").
HISTORY = re.compile(
    r"(?<![\w&])#\d{1,2}\b"
    r"|\b[Ii]ssue[ -]?#?\d+"
    r"|\b[Ss]ession[ -]\d+"
    r"|(?<!\bis )(?<!\bare )(?<!\bbe )(?<!\bwas )(?<!\bwere )(?<!\bbeing )(?<!\bbeen )\bused to\b"
    r"|\bbefore the fix\b"
)


def _hits(folder: str) -> list[str]:
    hits = []
    for path in sorted((ROOT / folder).rglob("*")):
        if path.suffix not in SUFFIXES or not path.is_file() or path == Path(__file__).resolve():
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if HISTORY.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:120]}")
    return hits


@pytest.mark.parametrize("folder", FOLDERS)
def test_no_history_in(folder):
    hits = _hits(folder)
    assert not hits, f"{len(hits)} line(s) tell history instead of what the code does:\n" + "\n".join(hits)


@pytest.mark.parametrize("line", ["fixed in #17", "(issue 16)", "Issue #19: refused", "issue-14 bench",
                                  "session 3's run", "Session 8: paired rounds", "it used to run the modules",
                                  "before the fix the plan failed"])
def test_history_is_found(line):
    assert HISTORY.search(line)


@pytest.mark.parametrize("line", ["color='#1f77b4'", "[Profiler](#profiler)", "a session of the allocator",
                                  "nested sessions both count", "the session's on_oom hooks",
                                  "the bytes that are used to store it", "x = y  # 2 layers", "reloads issued early"])
def test_code_vocabulary_is_not_history(line):
    assert not HISTORY.search(line)
