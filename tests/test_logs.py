"""launcher.observe.logs: the agent's console lines and events.jsonl, torchrun's log-directory
layout, and the output pump that copies worker pipes to files and the console."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import threading

from launcher.observe.logs import AgentLog, OutputPump, RunLogDir, read_events, render_prefix

LINE = re.compile(r"^\[ftrun \d\d:\d\d:\d\d\.\d{3} node(\S+) gen(\d+)\] (.*)$")


def _lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


def test_event_is_one_console_line_and_one_json_object(tmp_path, capsys) -> None:
    path = str(tmp_path / "run" / "events.jsonl")  # the directory is created
    log = AgentLog(node_rank=2, events_path=path)
    log.generation = 3
    log.info("spawn", "rank 5 started", rank=5, pid=42)
    log.error("worker-failed", "rank 5 [bold]died[/]", rank=5, generation=7)
    log.close()
    err = _lines(capsys.readouterr().err)
    assert len(err) == 2
    m = [LINE.match(ln) for ln in err]
    assert m[0] and m[0].groups() == ("2", "3", "rank 5 started")
    # rich markup in a message is printed literally; an explicit generation wins
    assert m[1] and m[1].groups() == ("2", "7", "rank 5 [bold]died[/]")
    recs = [json.loads(ln) for ln in open(path, encoding="utf-8")]
    assert [r["event"] for r in recs] == ["spawn", "worker-failed"]
    assert recs[0]["node"] == 2 and recs[0]["generation"] == 3 and recs[0]["rank"] == 5
    assert recs[0]["pid"] == 42 and recs[0]["message"] == "rank 5 started" and recs[0]["host"]
    assert recs[1]["generation"] == 7 and recs[0]["time"] <= recs[1]["time"]


def test_quiet_keeps_warnings_and_errors_and_unknown_node_is_question_mark(capsys) -> None:
    log = AgentLog(node_rank=None, events_path=None, quiet=True)
    log.info("x", "hidden")
    log.warning("y", "shown warning")
    log.error("z", "shown error")
    err = _lines(capsys.readouterr().err)
    assert [LINE.match(ln).group(3) for ln in err] == ["shown warning", "shown error"]
    assert all(LINE.match(ln).group(1) == "?" for ln in err)


def test_events_file_is_appended_and_closed(tmp_path, capsys) -> None:
    path = str(tmp_path / "events.jsonl")
    for gen in (0, 1):
        log = AgentLog(0, path, quiet=True)
        log.generation = gen
        log.info("tick", f"gen {gen}")
        log.close()
        log.info("after-close", "console only")  # no file write after close
    recs = [json.loads(ln) for ln in open(path, encoding="utf-8")]
    assert [(r["event"], r["generation"]) for r in recs] == [("tick", 0), ("tick", 1)]
    capsys.readouterr()


def test_non_json_fields_are_written_as_strings(tmp_path) -> None:
    path = str(tmp_path / "events.jsonl")
    log = AgentLog(0, path, quiet=True)
    log.info("odd", "m", where=tmp_path)
    log.close()
    assert json.loads(open(path, encoding="utf-8").read())["where"] == str(tmp_path)


def test_print_block_ends_with_one_newline(capsys) -> None:
    log = AgentLog(0, None)
    log.print_block("a\nb")
    log.print_block("c\n")
    assert capsys.readouterr().err == "a\nb\nc\n"


def test_run_log_dir_layout(tmp_path) -> None:
    d = RunLogDir.create(str(tmp_path / "base"), "job7")
    assert os.path.dirname(d.path) == str(tmp_path / "base")
    assert os.path.basename(d.path).startswith("job7_") and os.path.isdir(d.path)
    assert d.events_path == os.path.join(d.path, "events.jsonl")
    r = d.rank_dir(2, 1)
    assert r == os.path.join(d.path, "attempt_2", "1") and os.path.isdir(r)
    assert d.attempt_dir(2) == os.path.dirname(r)
    open(os.path.join(r, "stdout.log"), "w").close()
    assert os.listdir(d.rank_dir(2, 1, fresh=False)) == ["stdout.log"]
    assert os.listdir(d.rank_dir(2, 1)) == []  # fresh: the old attempt's files are gone
    other = RunLogDir.create(str(tmp_path / "base"), "job7")
    assert other.path != d.path  # two agents of one job never share a directory


def test_run_log_dir_without_base_is_a_temp_dir() -> None:
    d = RunLogDir.create(None, "r")
    try:
        assert os.path.basename(os.path.dirname(d.path)).startswith("torchelastic_")
    finally:
        shutil.rmtree(os.path.dirname(d.path))


def test_read_events_merges_runs_oldest_first(tmp_path) -> None:
    for name, times in (("a_1", [3.0, 1.0]), ("b_2", [2.0])):
        os.makedirs(tmp_path / name)
        with open(tmp_path / name / "events.jsonl", "w", encoding="utf-8") as f:
            for t in times:
                f.write(json.dumps({"time": t, "event": name}) + "\n\n")
    (tmp_path / "stray.jsonl").write_text('{"time": 0}\n')  # not a run directory: ignored
    assert [(e["time"], e["event"]) for e in read_events(str(tmp_path))] == [
        (1.0, "a_1"),
        (2.0, "b_2"),
        (3.0, "a_1"),
    ]
    assert read_events(str(tmp_path / "missing")) == []


def test_render_prefix_default_and_template() -> None:
    assert render_prefix(None, "trainer", 3, 11, "h") == "[trainer3]:"
    assert (
        render_prefix("${role_name}/${local_rank}/${rank}@${hostname} ", "r", 1, 9, "node-a")
        == "r/1/9@node-a "
    )


def _pump(tmp_path, data: bytes, **kw) -> tuple[bytes, str]:
    rd, wr = os.pipe()
    console = io.StringIO()
    out = str(tmp_path / "stdout.log")
    pump = OutputPump(os.fdopen(rd, "rb"), out, console, "[w0]:", **kw)
    with os.fdopen(wr, "wb") as w:
        w.write(data)
    pump.stop(timeout=10)
    with open(out, "rb") as f:
        return f.read(), console.getvalue()


def test_pump_copies_raw_bytes_to_file_and_prefixed_lines_to_console(tmp_path) -> None:
    data = b"hello\nbad \xff byte\nno newline at end"
    raw, console = _pump(tmp_path, data)
    assert raw == data  # the file keeps the exact bytes
    assert console == "[w0]:hello\n[w0]:bad \ufffd byte\n[w0]:no newline at end\n"


def test_pump_duplicates_filtered_lines(tmp_path) -> None:
    filtered = str(tmp_path / "filtered.log")
    _, console = _pump(
        tmp_path, b"loss=1\nnoise\nloss=2\n", filters=["loss"], filtered_path=filtered
    )
    assert console.count("\n") == 3
    assert open(filtered, encoding="utf-8").read() == "[w0]:loss=1\n[w0]:loss=2\n"


def test_pump_without_console_only_writes_the_file(tmp_path) -> None:
    rd, wr = os.pipe()
    out = str(tmp_path / "o.log")
    pump = OutputPump(os.fdopen(rd, "rb"), out, None, "[x]:")
    os.write(wr, b"a\nb\n")
    os.close(wr)
    pump.stop(timeout=10)
    assert open(out, "rb").read() == b"a\nb\n"
    assert not any(t.name == "pump[x]:" and t.is_alive() for t in threading.enumerate())
