"""Fault memory per device: the 24 h UCE rule and atomic, crash-safe state."""

from __future__ import annotations

import os

from launcher.control.fault_memory import FaultMemory


def test_second_uce_within_24h_counts(tmp_path) -> None:
    m = FaultMemory(str(tmp_path / "fm.json"))
    assert m.record_uce("h:0", now=1000.0) == 1
    assert m.record_uce("h:1", now=1001.0) == 1
    assert m.record_uce("h:0", now=1000.0 + 3600) == 2
    assert m.uce_count("h:0", now=1000.0 + 24.5 * 3600) == 1  # the first fell out of the window
    assert m.record_uce("h:0", now=1000.0 + 49 * 3600) == 1


def test_state_survives_a_new_instance_and_leaves_no_temp_files(tmp_path) -> None:
    path = str(tmp_path / "fm.json")
    FaultMemory(path).record_uce("h:3", now=5.0)
    assert FaultMemory(path).uce_count("h:3", now=6.0) == 1
    assert os.listdir(tmp_path) == ["fm.json"]


def test_corrupt_file_is_set_aside(tmp_path) -> None:
    path = tmp_path / "fm.json"
    path.write_text("{not json")
    assert FaultMemory(str(path)).record_uce("h:0", now=1.0) == 1
    assert (tmp_path / "fm.json.corrupt").exists()


def test_the_second_uce_within_the_window_is_evidence_of_a_repeat(tmp_path) -> None:
    m = FaultMemory(str(tmp_path / "fm.json"))
    assert m.record_uce_evidence("h:0", now=10.0) == {
        "device": "h:0",
        "uce_count_24h": 1,
        "repeat_uce": False,
    }
    assert m.record_uce_evidence("h:0", now=20.0)["repeat_uce"] is True
