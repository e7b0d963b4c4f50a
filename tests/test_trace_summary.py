"""``benchmarks.trace_summary``: a trace's threads, the time their events cover inside the
measured window (overlaps once), and their costliest names, read from a Perfetto JSON file."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from benchmarks.trace_summary import covered, find_trace, main, read_events, summarize, window


def test_covered_counts_overlaps_once() -> None:
    assert covered([]) == 0.0
    assert covered([(0, 10), (2, 5), (8, 12), (20, 25)]) == 17.0  # nested, overlapping, apart
    assert covered([(5, 6), (0, 1)]) == 2.0  # order does not matter


def write_trace(path: Path) -> Path:
    """Host thread: the window 100-200 us with spans in it and one after it; a GPU stream
    with kernels before, inside and across the window's end."""
    meta = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name", "args": {"name": "python"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 2, "tid": 3, "name": "thread_name", "args": {"name": "Stream #13"}},
    ]

    def x(pid: int, tid: int, name: str, ts: float, dur: float) -> dict[str, object]:
        return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}

    events = [
        x(1, 7, "bench/ar/measured run", 100, 100),
        x(1, 7, "llm/decode", 110, 30),
        x(1, 7, "PjitFunction(_forward_fn)", 115, 20),  # nested in the decode span
        x(1, 7, "llm/decode", 150, 10),
        x(1, 7, "llm/decode", 250, 10),  # after the window
        x(2, 3, "fusion.1", 50, 10),  # before it
        x(2, 3, "fusion.1", 120, 5),
        x(2, 3, "gemm", 130, 20),
        x(2, 3, "fusion.1", 190, 30),  # clipped at the window's end: 10 us
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as f:
        json.dump({"displayTimeUnit": "ns", "traceEvents": meta + events}, f)
    return path


def test_summary_of_the_measured_window(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "plugins" / "profile" / "run" / "vm.trace.json.gz")
    assert find_trace(tmp_path) == trace
    events = read_events(trace)
    start, end, name = window(events)
    assert (start, end, name) == (100.0, 200.0, "bench/ar/measured run")
    host, gpu = summarize(events, start, end, top=5)
    assert (host.process, host.thread, host.events, host.covered_us) == ("/host:CPU", "python", 3, 40.0)
    assert host.top == [("llm/decode", 2, 40.0), ("PjitFunction(_forward_fn)", 1, 20.0)]
    assert (gpu.process, gpu.thread, gpu.events, gpu.covered_us) == ("/device:GPU:0", "Stream #13", 3, 35.0)
    assert gpu.top == [("gemm", 1, 20.0), ("fusion.1", 2, 15.0)]


def test_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_trace(tmp_path / "t.trace.json.gz")
    main([str(tmp_path), "--top", "1"])
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "window: bench/ar/measured run, 0.10 ms"
    assert out[2] == "/host:CPU / python: 3 events covering 0.04 ms (40% of the window)"
    assert out[3].split() == ["0.040", "ms", "2", "x", "llm/decode"]
    assert out[4].startswith("/device:GPU:0 / Stream #13: 3 events covering 0.04 ms (35% of the window)")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="no \\*.trace.json.gz"):
        main([str(tmp_path / "empty")])
