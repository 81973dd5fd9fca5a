"""The one suite driver and the report helpers every suite shares (bench/driver.py, bench/reporting.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from croupier.bench import driver, reporting


def _drive(tmp_path: Path, measure, plots=driver.no_plots, say=lambda s: None) -> dict:
    return driver.drive("suite-x", tmp_path / "out", "croupier bench --suite x", measure,
                        lambda rep, made: f"# x\n{made}\n", plots, say)


def test_a_suite_writes_its_json_before_its_plots_and_markdown(tmp_path: Path) -> None:
    seen: dict = {}

    def plots(rep: dict, out: Path, stem: str) -> list[str]:
        seen["json"] = json.loads((out / f"{stem}.json").read_text())  # the figures are safe before any plot
        seen["md_yet"] = (out / f"{stem}.md").exists()
        return [str(out / f"{stem}-a.png")]

    rep = _drive(tmp_path, lambda rep: rep.update(cases=[{"samples": 3}]), plots)
    assert seen["json"]["cases"] == [{"samples": 3}] and not seen["md_yet"]
    assert (tmp_path / "out" / "suite-x.md").read_text() == f"# x\n{[str(tmp_path / 'out' / 'suite-x-a.png')]}\n"
    assert rep["suite"] == "suite-x" and rep["errors"] == []


def test_every_report_carries_the_runs_header(tmp_path: Path) -> None:
    rep = _drive(tmp_path, lambda rep: None)
    for key in ("command", "machine", "code", "revision", "started", "wall_s"):
        assert rep[key] is not None, key
    assert len(rep["load"]["start"]) == len(rep["load"]["end"]) == 3
    assert rep["machine"]["cores"] >= 1 and rep["command"] == "croupier bench --suite x"
    lines = reporting.header_lines(rep)
    assert lines[0] == "Command: `croupier bench --suite x`  " and lines[-1] == ""
    assert lines[1].startswith(f"Run: {rep['started']}, ") and f"revision {rep['revision']}" in lines[1]
    assert lines[2].startswith(f"Machine: {rep['machine']['cpu']}, ") and lines[3].startswith("Load average (1, 5, 15 min)")


def test_a_failed_case_is_reported_and_the_suite_carries_on(tmp_path: Path) -> None:
    said: list[str] = []

    def measure(rep: dict) -> None:
        def boom() -> int:
            raise RuntimeError("no server")

        rep["cases"] = [r for r in (driver.attempt(rep, "text | S3", boom, said.append),
                                    driver.attempt(rep, "text | FS", lambda: 7, said.append)) if r is not None]

    rep = _drive(tmp_path, measure)
    assert rep["cases"] == [7] and rep["errors"] == ["text | S3: no server"] and said == ["    failed: no server"]


def test_code_that_changes_during_a_run_is_an_error_of_the_run(tmp_path: Path, monkeypatch) -> None:
    states = iter(["abc1234", "abc1234 with uncommitted changes in server/app.py"])
    monkeypatch.setattr(reporting, "code_state", lambda: next(states))
    rep = _drive(tmp_path, lambda rep: None)
    assert rep["errors"] == ["the code changed during the run: abc1234 at the start, "
                             "abc1234 with uncommitted changes in server/app.py at the end"]


def test_the_driver_says_what_it_wrote_and_each_targets_verdict(tmp_path: Path) -> None:
    said: list[str] = []
    _drive(tmp_path, lambda rep: rep.update(targets=[reporting.target("text: 10x", 12.0, 10.0, "12 vs 1"),
                                                     reporting.target("images: 3x", None, 3.0, "not run")]),
           say=said.append)
    assert said[0].startswith(f"wrote {tmp_path / 'out' / 'suite-x.md'}, {tmp_path / 'out' / 'suite-x.json'} and 0 plots")
    assert said[1:] == ["  target met: text: 10x: 12 vs 1", "  target NOT met: images: 3x: not run"]


@pytest.mark.parametrize("value", [None, math.nan, math.inf])
def test_a_missing_figure_is_written_as_a_dash(value) -> None:
    assert reporting.num(value) == "-" and reporting.num(value, ".2f") == "-"


def test_a_figure_is_written_in_the_tables_format() -> None:
    assert reporting.num(12345.6) == "12,346" and reporting.num(0.1234, ".2f") == "0.12" and reporting.num(3, "") == "3"


def test_an_older_reports_header_leaves_out_what_it_did_not_record() -> None:
    # an autotune report of before the shared header: no revision, no machine, one load reading, at the end
    lines = reporting.header_lines({"command": "python -m croupier.bench.autotune", "load": [1.0, 2.0, 3.0]})
    assert lines == ["Command: `python -m croupier.bench.autotune`  ",
                     "Load average (1, 5, 15 min) at end 1.00, 2.00, 3.00 (the machine is shared: other processes "
                     "may have taken CPU during the run).", ""]
