"""The report tables show every cell whole, with or without ``tabulate``."""
from __future__ import annotations

import pytest

from magi_moe import text_tables
from magi_moe.text_tables import format_table

LONG = ["controls: " + "a kernel that forgets to round " * 3 + "first",
        "controls: " + "a kernel that forgets to round " * 3 + "second"]


@pytest.fixture(params=["tabulate", "plain"])
def renderer(request, monkeypatch):
    if request.param == "tabulate":
        pytest.importorskip("tabulate")
    else:
        monkeypatch.setattr(text_tables, "_tabulate", None)
    return request.param


def test_long_cells_are_not_cut(renderer):
    text = format_table(["subject", "ms"], [[LONG[0], "1.5"], [LONG[1], "12.25"]], numeric_columns=[1])
    lines = text.splitlines()
    assert len(lines) == 4, text
    assert LONG[0] in lines[2] and LONG[1] in lines[3]
    # numbers right-aligned: both end in the same column
    assert lines[2].rstrip().endswith("1.5") and lines[3].rstrip().endswith("12.25")
    assert len(lines[2].rstrip()) == len(lines[3].rstrip())


def test_cells_are_shown_as_given(renderer):
    text = format_table(["a", "b"], [["2.38e-03", None]])
    assert "2.38e-03" in text and "None" not in text


def test_a_row_of_the_wrong_width_is_refused():
    with pytest.raises(ValueError, match="row 1 has 1 cells, expected 2"):
        format_table(["a", "b"], [["x", "y"], ["z"]])


def test_audit_summary_counts_and_names_every_failure_whole():
    from magi_moe.audit.report import FAIL, PASS, SKIP, Row, summary_table

    rows = [Row("controls", LONG[0], FAIL, ""), Row("controls", LONG[1], FAIL, ""),
            Row("controls", "ok", PASS, ""), Row("cache", "fused", SKIP, "")]
    lines = summary_table(rows).splitlines()
    assert lines[0].split() == ["section", "pass", "FAIL", "info", "skip", "failures"]
    controls = next(line for line in lines if line.startswith("controls"))
    assert controls.split()[1:5] == ["1", "2", "0", "0"]
    assert f"{LONG[0]}, {LONG[1]}" in controls
    assert next(line for line in lines if line.startswith("cache")).split()[1:5] == ["0", "0", "0", "1"]
