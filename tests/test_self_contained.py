"""The repository speaks of itself: no tracked text file points at what a reader of a clone
cannot see — paths outside the repository (`../shared`, design seed files), tracker issue
numbers ("issue 23", "#24"), numbered work sessions ("stop 26") or the design brief's section
numbers ("mission 3.6.4"). Design sources are cited by their public names instead (papers,
projects), times by date. A public repository's own issue or PR ("owner/repo PR #12",
"owner/repo#12") is a public name and passes.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SELF = Path(__file__).resolve().relative_to(REPO).as_posix()

BINARY_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".gif", ".msgpack", ".pdf", ".gz", ".zip"})

RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("path outside the repository", re.compile(r"\.\./shared\b|(?<![\w.-])/work/shared\b")),
    ("design seed file", re.compile(r"\bshared/seeds\b|\bseeds?/|\b\d{3}_[0-9a-f]{16}\.txt\b")),
    (
        "design seed by number",
        re.compile(r"\b[Ss]eeds? 0\d\d\b|\bthe seed's\b|\bseed documents?\b"),
    ),
    (
        "design brief by section",
        re.compile(r"\b[Mm]ission(?:'s)? (?:rule )?[AB]?\d|\bthe mission\b"),
    ),
    (
        "numbered work session",
        re.compile(r"\b[Ss]tops? \d+\b|(?<![A-Za-z])stop\d+\b|\bthis stop\b|\bthe stop's\b"),
    ),
    (
        "numbered work session",
        re.compile(r"\((?:first|second|third|fourth|fifth|sixth|seventh|eighth) session\)"),
    ),
    ("the brief", re.compile(r"\bthe brief(?:'s)?\b|\bCEO\b")),
)
"""What a reader cannot resolve, each with why it is flagged."""

ISSUE = re.compile(r"\b(?:[Ii]ssues?|PRs?)\s+#?\d+\b|(?<![\w/&#])#\d{1,5}\b")
"""An issue or PR number, or a bare `#N`; allowed only right after an `owner/repo` name."""
PUBLIC_REPO_BEFORE = re.compile(r"[\w.-]+/[\w.-]+\s+(?:(?:issues?|PRs?)\s+)?$")


@dataclass(frozen=True, slots=True)
class Offence:
    """One line that points outside the repository."""

    path: str
    line: int
    why: str
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.why}: {self.text.strip()[:120]}"


def offences_in(path: str, text: str) -> list[Offence]:
    """Every offending line of one file's text."""
    found: list[Offence] = []
    for number, line in enumerate(text.splitlines(), 1):
        for why, rule in RULES:
            if rule.search(line):
                found.append(Offence(path, number, why, line))
        for m in ISSUE.finditer(line):
            if not PUBLIC_REPO_BEFORE.search(line[: m.start()]):
                found.append(Offence(path, number, "issue number", line))
    return found


def tracked_text_files() -> list[tuple[str, str]]:
    """(path, text) of every tracked file that decodes as UTF-8, this test excepted."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: nothing tracked to check")
    files: list[tuple[str, str]] = []
    for name in out.decode().split("\0"):
        path = REPO / name
        if not name or name == SELF or path.suffix in BINARY_SUFFIXES or not path.is_file():
            continue
        try:
            files.append((name, path.read_text(encoding="utf-8")))
        except UnicodeDecodeError:
            continue
    return files


def test_tracked_text_points_nowhere_outside_the_repository() -> None:
    files = tracked_text_files()
    assert len(files) > 100  # the listing worked
    offences = [o for name, text in files for o in offences_in(name, text)]
    assert not offences, "\n".join(map(str, offences))


@pytest.mark.parametrize(
    "line",
    [
        "the founding design is `../shared/ARCHITECTURE.md`",
        "trace:/work/shared/data/trace.jsonl",
        "see seeds/002_790db75bbd5d044d.txt",
        "the chunk pool of seed 002",
        "the seed's text format",
        "request classes of mission 3.6.4",
        "single-owner (mission rule 1)",
        "## Planner (issue 6)",
        "Issue 23's regime",
        "issues 23 + 24",
        "as #24 asked",
        "Past the knee, stop 25",
        "results/run_20261126_stop26.json",
        "the stop's first commit",
        "2026-11-25 (fifth session): the floor",
        "(the brief's limit)",
    ],
)
def test_each_kind_of_outside_reference_is_caught(line: str) -> None:
    assert offences_in("x.md", line)


@pytest.mark.parametrize(
    "line",
    [
        "OpenCode >= 1.17 (BYK/loreai PR #687)",
        "router-for-me/CLIProxyAPI issue #4452",
        "vllm-project/vllm#12345",
        "color='#4c72b0'",
        "data/mooncake_synthetic_trace.jsonl",
        "the stop string ends the answer",
        "batches `start..stop-1` are gone",
        "workload `mixed` (seed 0, scale 1), random seed 3",
        "the sidecar's shared prefix",
        "be brief",
        "admission and submission",
        "#### Heading",
    ],
)
def test_public_names_and_plain_words_pass(line: str) -> None:
    assert offences_in("x.md", line) == []
