"""The fault table (docs/faults.md) names, for every fault, the tests that check
what it gets: each named test must exist (a renamed or deleted test would
leave the table unchecked)."""

from __future__ import annotations

import re

from conftest import REPO_ROOT


def _rows():
    text = (REPO_ROOT / "docs" / "faults.md").read_text()
    section = text.split("# Faults and what they get", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| Fault")]
    return [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows]


def test_every_fault_names_tests_that_exist():
    rows = _rows()
    assert len(rows) >= 10, rows
    for fault, gets, when, tests in rows:
        assert fault and gets and when and tests, (fault, gets, when, tests)
        names = re.findall(r"`([^`]+::[A-Za-z0-9_]+)`", tests)
        assert names, f"{fault!r} names no test"
        for name in names:
            path, function = name.split("::")
            source = (REPO_ROOT / path).read_text()
            assert re.search(rf"(def|fn) {function}\(", source), f"{fault!r}: no test {function} in {path}"
