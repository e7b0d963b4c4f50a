"""A text summary of a ``jax.profiler`` trace (``benchmarks.run --profile DIR``): where a
measured window's time went, on the host and on each device stream, without a viewer.

Why: a lent GPU is held for minutes and its files come back only in small numbers; a summary
printed there says at once whether a step is the device's (kernels back to back) or the host's
(the device idle between kernels while Python schedules, packs and dispatches), and which
kernels and host spans cost the most. It reads the Perfetto ``*.trace.json.gz`` that
``jax.profiler`` writes beside its ``*.xplane.pb``.

For the window (the ``bench/...`` span of the measured run, else the whole trace) and each
thread with events in it: its events, the time they cover (overlapping and nested events
counted once) and that as a share of the window, then its costliest event names by total
duration. Usage: ``python -m benchmarks.trace_summary DIR_OR_FILE [--top N]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

from omni_jax.cli_errors import plain_text

WINDOW_PREFIX = "bench/"
"""Names of the measured spans :func:`benchmarks.harness.measured_window` opens."""


@dataclasses.dataclass(frozen=True)
class Event:
    """One complete event (``"ph": "X"``) of a trace: times in microseconds."""

    process: str
    thread: str
    name: str
    start: float
    duration: float

    @property
    def end(self) -> float:
        return self.start + self.duration


@dataclasses.dataclass(frozen=True)
class ThreadSummary:
    """One thread's events inside the window: how many, the time they cover (their union), and
    the costliest names as ``(name, calls, total microseconds)``, costliest first."""

    process: str
    thread: str
    events: int
    covered_us: float
    top: list[tuple[str, int, float]]


def find_trace(path: Path) -> Path:
    """``path`` itself when it is a file, else the newest ``*.trace.json.gz`` under it."""
    if path.is_file():
        return path
    found = sorted(path.rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise SystemExit(f"{path}: no *.trace.json.gz under it (was the run given --profile?)")
    return found[-1]


def read_events(path: Path) -> list[Event]:
    """The complete events of a Perfetto JSON trace, with process and thread names resolved."""
    with gzip.open(path, "rt") as f:
        trace = json.load(f)
    records = trace["traceEvents"] if isinstance(trace, dict) else trace
    processes: dict[int, str] = {}
    threads: dict[tuple[int, int], str] = {}
    for r in records:
        if r.get("ph") == "M" and r.get("name") == "process_name":
            processes[r["pid"]] = r["args"]["name"]
        elif r.get("ph") == "M" and r.get("name") == "thread_name":
            threads[(r["pid"], r["tid"])] = r["args"]["name"]
    return [
        Event(
            processes.get(r["pid"], str(r["pid"])),
            threads.get((r["pid"], r.get("tid", 0)), str(r.get("tid", 0))),
            r["name"],
            float(r["ts"]),
            float(r.get("dur", 0.0)),
        )
        for r in records
        if r.get("ph") == "X"
    ]


def covered(intervals: Iterable[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals: nested or overlapping time once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def window(events: Sequence[Event]) -> tuple[float, float, str]:
    """The measured window: the first ``bench/...`` span, else the whole trace."""
    for e in events:
        if e.name.startswith(WINDOW_PREFIX):
            return e.start, e.end, e.name
    if not events:
        raise SystemExit("the trace holds no events")
    return min(e.start for e in events), max(e.end for e in events), "the whole trace"


def summarize(events: Sequence[Event], start: float, end: float, top: int) -> list[ThreadSummary]:
    """Each thread's :class:`ThreadSummary` over the events that begin inside ``[start, end)``
    (clipped to it), busiest first. The window's own span is left out."""
    by_thread: dict[tuple[str, str], list[Event]] = defaultdict(list)
    for e in events:
        if start <= e.start < end and not e.name.startswith(WINDOW_PREFIX):
            by_thread[(e.process, e.thread)].append(e)
    out = []
    for (process, thread), group in by_thread.items():
        totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        for e in group:
            totals[e.name][0] += 1
            totals[e.name][1] += min(e.end, end) - e.start
        ranked = sorted(((n, int(c), t) for n, (c, t) in totals.items()), key=lambda x: -x[2])
        span = covered((e.start, min(e.end, end)) for e in group)
        out.append(ThreadSummary(process, thread, len(group), span, ranked[:top]))
    return sorted(out, key=lambda s: -s.covered_us)


def report(summaries: Sequence[ThreadSummary], length_us: float, name: str) -> str:
    lines = [f"window: {name}, {length_us / 1e3:.2f} ms"]
    for s in summaries:
        lines.append(
            f"{s.process} / {s.thread}: {s.events} events covering {s.covered_us / 1e3:.2f} ms "
            f"({s.covered_us / length_us:.0%} of the window)"
        )
        lines.extend(f"    {t / 1e3:9.3f} ms  {c:6d} x  {n[:100]}" for n, c, t in s.top)
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.trace_summary", description=plain_text(__doc__)
    )
    parser.add_argument("path", type=Path, help="a *.trace.json.gz, or the --profile directory")
    parser.add_argument("--top", type=int, default=12, help="names listed per thread")
    args = parser.parse_args(argv)
    trace = find_trace(args.path)
    events = read_events(trace)
    start, end, name = window(events)
    print(f"trace: {trace}")
    print(report(summarize(events, start, end, args.top), end - start, name))


if __name__ == "__main__":
    main()
