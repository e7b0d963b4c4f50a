"""How the code2wav runner splits waiting requests into solves, and the cost fit that decides it.

A stand-in solve (zeros, one call recorded per solve) keeps these free of any model: what is
tested is which requests share a solve, in which order steps run them, and that nothing is
lost or reordered on the way.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from stand_ins import Gate, held, stand_in_code2wav_runner

from omni_jax.engine.generation_runner import GenerationRunner
from omni_jax.engine.solve_cost import MIN_OVERHEAD, SolveCost
from omni_jax.stages.code2wav_batch import Code2WavRequest
from omni_jax.stages.code2wav_params import Token2WavParams

SAMPLES_PER_FRAME = 3


def make_runner(
    calls: list[list[int]], max_batch: int = 8, max_solve_codes: int | None = None
) -> GenerationRunner:
    return stand_in_code2wav_runner(
        calls,
        samples_per_frame=SAMPLES_PER_FRAME,
        max_codes=512,
        max_batch=max_batch,
        max_solve_codes=max_solve_codes,
    )


def request(name: str, num_codes: int) -> Code2WavRequest:
    return Code2WavRequest.new(
        name,
        np.ones(num_codes, np.int32),
        np.zeros(3, np.float32),
        np.zeros((5, 4), np.float32),
        Token2WavParams(seed=0),
    )


def test_fit_skips_compiles_and_reads_the_overhead() -> None:
    cost = SolveCost(cap=4096.0)
    assert cost.overhead() == MIN_OVERHEAD  # nothing timed: solves follow the code buckets
    assert cost.seconds(64) is None
    a, b = 0.02, 1e-4  # a solve's fixed seconds, seconds per padded code-row
    for n in (64, 128, 512):
        cost.record((n,), n, 100.0)  # a shape's first solve compiles: never counted
        cost.record((n,), n, a + b * n + 0.5)  # a slow run, then the real cost
        cost.record((n,), n, a + b * n)
        if n == 64:  # one size timed: its time, scaled up past it, never down
            assert cost.seconds(32) == cost.seconds(64) == pytest.approx(a + b * 64)
            assert cost.seconds(128) == pytest.approx(2 * (a + b * 64))
    assert cost.overhead() == pytest.approx(a / b)
    assert cost.seconds(1024) == pytest.approx(a + b * 1024)
    assert cost.seconds(1) == pytest.approx(a + b * 64)  # never under the fastest solve timed


def test_fit_without_a_slope_groups_everything() -> None:
    cost = SolveCost(cap=4096.0)
    for n in (64, 512):  # a device that solves eight rows as fast as one
        cost.record((n,), n, 1.0)
        cost.record((n,), n, 1.0)
    assert cost.overhead() == 4096.0
    assert cost.seconds(4096) == pytest.approx(1.0)


def ids(groups: list[list[Code2WavRequest]]) -> list[list[str]]:
    return [[r.request_id for r in g] for g in groups]


def test_groups_weigh_padding_against_solves(monkeypatch: pytest.MonkeyPatch) -> None:
    runner = make_runner([])
    lengths = {"a": 100, "b": 20, "c": 100, "d": 20, "e": 100, "f": 40, "g": 100}
    waiting = [request(name, n) for name, n in lengths.items()]
    # Cheap solves: shortest first, one code bucket (32, 48, 128 codes) each.
    assert ids(runner.groups(waiting)) == [["b", "d"], ["f"], ["a", "c", "e", "g"]]
    monkeypatch.setattr(runner.cost, "overhead", lambda: 1000.0)  # dear solves: one for all
    assert ids(runner.groups(waiting)) == [["b", "d", "f", "a", "c", "e", "g"]]
    # Three rows pad to four: with cheap solves, 2 + 1 rows of 128 codes beat 4.
    monkeypatch.setattr(runner.cost, "overhead", lambda: MIN_OVERHEAD)
    assert [len(g) for g in runner.groups(waiting[:1] + waiting[2:3] + waiting[4:5])] in ([1, 2], [2, 1])


def test_a_step_runs_the_oldest_requests_solve_and_keeps_the_rest_in_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[list[int]] = []
    runner = make_runner(calls)
    for name, n in [("long", 100), ("short", 20), ("long2", 100), ("short2", 20)]:
        runner.add(request(name, n))
    first = runner.step()
    assert [r.request.request_id for r in first] == ["long", "long2"]
    assert [len(r.output) for r in first] == [100 * 2 * SAMPLES_PER_FRAME] * 2
    assert [r.request_id for r in runner._waiting] == ["short", "short2"]
    runner.add(request("short3", 30))  # arrives in time to join the next solve (solves made dear)
    monkeypatch.setattr(runner.cost, "overhead", lambda: 1000.0)
    second = runner.step()
    assert [r.request.request_id for r in second] == ["short", "short2", "short3"]
    assert not runner.has_work() and calls == [[100, 100], [20, 20, 30, 1]]


def test_long_requests_are_solved_a_few_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """With at most 512 rows x codes a solve, eight requests of 100 codes (bucket 128) go four at
    a time even when one solve for all would be cheapest, and one of 500 codes (bucket 512)
    alone; the short ones still share. Steps run them all, oldest first, none lost."""
    calls: list[list[int]] = []
    runner = make_runner(calls, max_solve_codes=512)
    assert (8, 128) not in runner.buckets.shapes() and (4, 128) in runner.buckets.shapes()
    assert [r for r, n in runner.buckets.shapes() if n == 512] == [1]
    monkeypatch.setattr(runner.cost, "overhead", lambda: 1e9)  # dear solves: as few as allowed
    waiting = [request(f"mid{i}", 100) for i in range(6)] + [request("long", 500), request("short", 20)]
    groups = runner.groups(waiting)
    assert all(runner.buckets.fits(*runner.shape(g)) for g in groups)
    assert sorted(len(g) for g in groups) == [1, 3, 4] and ids(groups)[-1] == ["long"]
    for r in waiting:
        runner.add(r)
    done = []
    while runner.has_work():
        done += [r.request.request_id for r in runner.step()]
    assert sorted(done) == sorted(r.request_id for r in waiting)
    assert all(len(c) <= 4 for c in calls) and [500] in calls
    with pytest.raises(
        ValueError, match=r"a solve of 5 requests padded to 128 is 8 x 128, more than the 512"
    ):
        runner.shape([request(f"x{i}", 100) for i in range(5)])


def test_a_solve_left_in_flight_lands_once_the_device_has_it() -> None:
    """``step(block=False)`` dispatches the oldest request's solve and returns at once; while the
    device has not finished it the runner has work, counts its requests as solving and its steps
    return nothing (requests still arrive and wait); a step after it lands it (without the rows
    of a request removed meanwhile) and dispatches the next. A solve left with no request is
    forgotten. ``step()`` (blocking) lands the solve in flight and returns it at once, the next
    left in flight (its requests need not wait for another solve); the next ``step()`` lands it."""
    calls: list[list[int]] = []
    runner = make_runner(calls)
    gate = Gate()
    runner.solve = held(runner.solve, gate)
    for name in ("a", "b"):
        runner.add(request(name, 100))
    assert runner.step(block=False) == [] and (len(runner.solving), runner.num_waiting) == (2, 0)
    runner.add(request("c", 20))
    assert runner.step(block=False) == [] and runner.has_work() and runner.num_waiting == 1
    runner.remove(lambda r: r.request_id == "b")
    assert len(runner.solving) == 1
    gate.open = True
    landed = runner.step(block=False)
    assert [(r.request.request_id, r.batch_size) for r in landed] == [("a", 2)]
    assert len(landed[0].output) == 100 * 2 * SAMPLES_PER_FRAME
    assert (len(runner.solving), runner.num_waiting) == (1, 0)  # c's solve in flight
    runner.remove(lambda r: r.request_id == "c")
    assert runner.in_flight is None and not runner.has_work()
    for name in ("d", "e"):
        runner.add(request(name, 20))
    runner.step(block=False)
    runner.add(request("f", 100))
    assert [r.request.request_id for r in runner.step()] == ["d", "e"] and len(runner.solving) == 1
    assert [r.request.request_id for r in runner.step()] == ["f"]
    assert not runner.has_work() and calls == [[100, 100], [20], [20, 20], [100]]


def test_a_failed_solve_left_in_flight_ends_only_its_request() -> None:
    """A device error raised when a solve is dispatched without waiting lands in the next step
    as one raised when it is read would: retried one request at a time, only the culprit ends
    with the message."""
    runner = make_runner([])
    solve = runner.solve

    def faulty(graph, state, codes, code_lengths, *rest):  # noqa: ANN001, ANN002, ANN202 - a stand-in
        if 7 in np.asarray(code_lengths):
            raise jax.errors.JaxRuntimeError("device fault")
        return solve(graph, state, codes, code_lengths, *rest)

    runner.solve = faulty
    runner.add(request("bad", 7))
    runner.add(request("good", 8))
    assert runner.step(block=False) == [] and len(runner.solving) == 2
    landed = runner.step(block=False)
    assert [(r.request.request_id, r.error) for r in landed] == [
        ("bad", "solve failed: device fault"),
        ("good", None),
    ]
    assert not runner.has_work()
