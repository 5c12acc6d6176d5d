"""The module indexes name every module that exists: ``tools/__init__.py``'s docstring and the maintainer-scripts
table of docs/architecture.md (each runnable script), and the docstring of each ``refusion_cli`` subpackage that
lists its modules."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "refusion_cli"
# subpackages whose __init__ docstring lists their modules, and those whose docstring says what the whole does
LISTS_ITS_MODULES = ["bench", "chat", "harness", "serve", "tasks", "training"]
SAYS_WHAT_IT_DOES = ["cli", "decoding", "models"]


def modules_of(folder: Path) -> list[str]:
    return sorted(path.stem for path in folder.glob("*.py") if not path.name.startswith("_"))


def docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""


def named(module: str, text: str) -> bool:
    """``text`` names ``module`` as an index does: in double backticks, as ``module.py``, or in a list in brackets
    such as "(loop, resume)"; not as a plain word of a sentence ("the frontier" does not name frontier.py)."""
    name = re.escape(module)
    return re.search(rf"``{name}``|(?<![\w.]){name}\.py\b|[(,]\s*{name}\s*[,)]", text) is not None


def maintainer_scripts_table() -> str:
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("\n## Maintainer scripts\n", 1)[1].split("\n## ", 1)[0]
    return "\n".join(line for line in section.splitlines() if line.startswith("|"))


def runnable(path: Path) -> bool:
    return 'if __name__ == "__main__":' in path.read_text(encoding="utf-8")


def test_every_tool_is_in_the_tools_docstring():
    index = docstring(ROOT / "tools" / "__init__.py")
    assert [module for module in modules_of(ROOT / "tools") if not named(module, index)] == []


def test_every_runnable_tool_is_in_the_maintainer_scripts_table():
    table = maintainer_scripts_table()
    scripts = [path.stem for path in sorted((ROOT / "tools").glob("*.py")) if runnable(path)]
    assert "build_models" in scripts  # the check sees the scripts
    assert [name for name in scripts if not re.search(rf"tools[./]{name}\b", table)] == []


def test_each_subpackage_is_sorted_into_listing_its_modules_or_not():
    """A new subpackage is put in one of the two lists, so that its index is checked when it keeps one."""
    subpackages = sorted(path.parent.name for path in PACKAGE.glob("*/__init__.py"))
    assert subpackages == sorted(LISTS_ITS_MODULES + SAYS_WHAT_IT_DOES)


@pytest.mark.parametrize("subpackage", LISTS_ITS_MODULES)
def test_a_subpackage_index_names_each_of_its_modules(subpackage):
    index = docstring(PACKAGE / subpackage / "__init__.py")
    assert [module for module in modules_of(PACKAGE / subpackage) if not named(module, index)] == []
