"""The README stays a short guide, and the documentation's relative links lead somewhere."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250
DESIGN_NOTES = "DESIGN" + ".md"  # notes kept outside the repository; spelled so this file does not cite them
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")  # [text](target)
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def documentation_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def tracked_files() -> list[Path]:
    listing = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=False)
    if listing.returncode != 0:
        pytest.skip("not a git checkout")
    return [ROOT / name for name in listing.stdout.decode().split("\0") if name]


def relative_links(page: Path) -> list[str]:
    """Link targets outside code blocks that are neither URLs nor anchors on the same page."""
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    targets = [target.split("#", 1)[0] for target in LINK.findall(text)]
    return [target for target in targets if target and not re.match(r"[a-z][a-z0-9+.-]*:", target)]


def test_readme_is_a_short_guide() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move details to docs/"


def test_the_docs_folder_has_pages() -> None:
    assert len(documentation_pages()) > 1


def test_no_tracked_file_cites_design_notes_outside_the_repository() -> None:
    citing = []
    for path in tracked_files():
        if not path.is_file():
            continue  # deleted in the working tree, not yet committed
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # a binary file (weights, plots)
        if DESIGN_NOTES in text:
            citing.append(str(path.relative_to(ROOT)))
    assert not citing, f"these files cite {DESIGN_NOTES}: {citing}"


@pytest.mark.parametrize("page", documentation_pages(), ids=lambda page: str(page.relative_to(ROOT)))
def test_relative_links_point_to_existing_files(page: Path) -> None:
    missing = [target for target in relative_links(page) if not (page.parent / target).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to missing files: {missing}"
