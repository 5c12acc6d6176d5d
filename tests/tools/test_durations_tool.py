"""``tools.test_durations``: a full run's JUnit XML into seconds per test file, and the order the workers take
the files in (tests/conftest.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests import conftest
from tools.test_durations import durations, file_of, main

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.a.test_one" name="test_x" time="1.25"/>
<testcase classname="tests.a.test_one" name="test_y[2]" time="0.50"/>
<testcase classname="tests.a.test_two.TestGroup" name="test_z" time="3.00"/>
</testsuite></testsuites>"""


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "tests" / "a").mkdir(parents=True)
    for name in ("test_one.py", "test_two.py"):
        (tmp_path / "tests" / "a" / name).write_text("")
    (tmp_path / "junit.xml").write_text(JUNIT)
    return tmp_path


def test_seconds_add_up_per_file_longest_first(tree):
    assert file_of("tests.a.test_two.TestGroup", tree) == "tests/a/test_two.py"
    assert list(durations(tree / "junit.xml", tree).items()) == [("tests/a/test_two.py", 3.0),
                                                                 ("tests/a/test_one.py", 1.8)]
    with pytest.raises(ValueError, match="no test file for 'tests.a.missing'"):
        file_of("tests.a.missing", tree)


def test_a_missing_file_is_one_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main([str(tmp_path / "nowhere.xml"), "--out", str(tmp_path / "out.json")])
    assert stop.value.code == 2 and "no such file" in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()


def test_the_workers_take_the_longest_files_first_each_in_its_own_order(monkeypatch, tmp_path):
    known = tmp_path / "durations.json"
    known.write_text('{"tests/b.py": 9.0, "tests/c.py": 0.2}')
    monkeypatch.setattr(conftest, "DURATIONS", known)
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    ids = ["tests/c.py::a", "tests/new.py::a", "tests/b.py::b", "tests/new.py::b", "tests/b.py::a"]
    items = [SimpleNamespace(nodeid=nodeid) for nodeid in ids]
    conftest.pytest_collection_modifyitems(None, None, items)
    # b (9 s), the file no run has timed (2 tests at 0.5 s), c (0.2 s); each file's tests as collected
    assert [item.nodeid for item in items] == ["tests/b.py::b", "tests/b.py::a", "tests/new.py::a",
                                               "tests/new.py::b", "tests/c.py::a"]
