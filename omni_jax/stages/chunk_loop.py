"""The streamed-decode loop both code2wav families share: requests decoded chunk by chunk as
their codes arrive, the ready chunks of several requests in one padded solve.

:class:`StreamedDecoder` owns what does not depend on the model: the table of streamed requests,
taking their codes, choosing the oldest ``max_batch`` with a chunk ready, one padded solve of a
``(rows, window)`` pair of :class:`~omni_jax.engine.generation_runner.SolveBuckets` (the window the
smallest of the family's that holds every chunk of the solve: a first chunk, shorter, need not pay
for a whole middle chunk's window, which is most of a request's first-audio time), ready chunks
split into solves as the offline runner splits requests
(:meth:`~omni_jax.engine.generation_runner.SolveBuckets.split`, weighing padding against the
fitted cost of one more solve), the failure rules of
:meth:`~omni_jax.engine.generation_runner.GenerationRunner.run` (a device error retried one
request at a time, a row with non-finite audio failing alone) and warm-up (one program per
``(rows, window)``). A subclass supplies the model: where a request's next chunk is and how
wide its window is, how chunks pad into a batch, the solve and its host results, a row's audio
and how a request advances.

A solve need not be waited for: :meth:`StreamedDecoder.step` with ``block=False`` dispatches it
and returns, and a later step takes its results once the device has them (one solve in flight
at a time). Why: the engine core steps every stage from one thread, and a solve it waited for
held the talker's steps back for the solve's whole length even where the two stages run on
different devices; the talker that feeds the chunks now keeps stepping meanwhile.

A ready chunk may wait for other requests' to share its solve (:meth:`StreamedDecoder.gathering`)
where one more solve costs more than a row (an accelerator: a solve of eight chunks costs about
what one does) and for as long as its request's audio still to play outlasts a solve: the
listener hears no difference, and the device does fewer, fuller solves.
"""

from __future__ import annotations

import abc
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from omni_jax.engine.compilation import ProgramCall, compile_ahead
from omni_jax.engine.generation_runner import PaddedBatch, SolveBuckets
from omni_jax.engine.in_flight import InFlight
from omni_jax.engine.solve_cost import SolveCost
from omni_jax.jit import StaticGraph
from omni_jax.parallel.mesh import axis_size

SLACK = 2.0
"""How many times the expected wait for a chunk's audio (a whole solve, and the time between two
steps, when the wait is next looked at) its request's audio still to play must cover, beyond its
last chunk, for the chunk to wait for other requests' (:meth:`StreamedDecoder.gathering`). The
expectation is a fit to this decoder's own timings; twice it absorbs a slow solve or step."""


@dataclasses.dataclass
class Playback:
    """A streamed request's audio so far as its listener hears it, played from when its first
    chunk landed (``start``, the decoder's clock), as a client playing each chunk on arrival
    would: ``seconds`` in all, ``last`` of them its latest chunk's."""

    start: float
    seconds: float = 0.0
    last: float = 0.0

    def add(self, seconds: float) -> None:
        self.seconds += seconds
        self.last = seconds

    def left(self, now: float) -> float:
        """Seconds of audio not yet played at ``now``."""
        return self.start + self.seconds - now


@dataclasses.dataclass
class StreamState:
    """What the loop reads and writes of a streamed request: its id, the codes received so far
    and whether they are all, how many chunks were decoded (``done``) and their audio's
    :class:`Playback` (from the first chunk on). A family's record adds its own fields (its plan,
    its progress)."""

    request_id: str
    codes: list[int] = dataclasses.field(default_factory=list, kw_only=True)
    finished: bool = dataclasses.field(default=False, kw_only=True)
    done: int = dataclasses.field(default=0, kw_only=True)
    played: Playback | None = dataclasses.field(default=None, kw_only=True)


R = TypeVar("R", bound=StreamState)
"""A streamed request's record (the subclass's)."""
W = TypeVar("W")
"""Where a chunk is cut (the subclass's: a chunk plan's entry)."""
B = TypeVar("B", bound=PaddedBatch)
"""One chunk solve's padded inputs."""
H = TypeVar("H")
"""One chunk solve's results, on the host."""


@dataclasses.dataclass
class StreamedChunk(Generic[W]):
    """A chunk's emitted audio; ``last`` when the request has no more. ``chunk``: where it was cut
    (``None`` for the empty end of a request whose every code an earlier chunk voiced).
    ``error``: the chunk's solve failed (``audio`` is then empty and the request is forgotten: it
    has no more). The solve's seconds and requests: ``solve_s``, ``batch_size``."""

    request_id: str
    chunk: W | None
    audio: np.ndarray
    last: bool
    solve_s: float = 0.0
    batch_size: int = 0
    error: str | None = None


class StreamedDecoder(abc.ABC, Generic[R, W, B, H]):
    """Streamed requests: a subclass's ``add``, :meth:`extend` with codes as they come,
    :meth:`step`.

    ``model`` is split once (its graph static, its state an argument of every solve);
    ``windows`` are the padded window lengths a solve may have (the family's first-chunk window
    and its longest), so a solve's shape is one of a closed set;
    ``mesh`` as for the :class:`~omni_jax.engine.generation_runner.GenerationRunner` (rows split
    over ``data``); ``sample_rate`` the audio's, which times what a request's listener has yet to
    hear. ``unit`` names what a request's codes count in messages (a code, a frame). ``clock``
    reads the seconds chunks' playback is timed in.
    """

    unit = "code"

    def __init__(
        self,
        model: nnx.Module,
        *,
        windows: Sequence[int],
        max_batch: int,
        mesh: Mesh | None,
        sample_rate: int,
    ):
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch} must be >= 1")
        graphdef, self.state = nnx.split(model)
        self.graph = StaticGraph(graphdef)
        self.max_batch = max_batch
        self.mesh = mesh
        self.buckets = SolveBuckets.build(max_batch, sorted(set(windows)), axis_size(mesh, "data"))
        rows, window = self.buckets.largest()
        self.cost = SolveCost(cap=float(rows * window))
        self.sample_rate = sample_rate
        self.clock: Callable[[], float] = time.perf_counter
        self._requests: dict[str, R] = {}
        self._last_step: float | None = None
        self._gap = 0.0  # seconds between the last two steps
        self.in_flight: InFlight[tuple[R, W]] | None = None

    @abc.abstractmethod
    def next_window(self, request: R) -> W | None:
        """The request's next chunk, when it is ready."""

    def drained(self, request: R) -> bool:
        """Finished with every code voiced by an earlier chunk: it ends with no chunk (never, for
        a model whose last chunk is always a solve)."""
        return False

    def short_of(self, request: R) -> int | None:
        """The codes (frames) the request still needs before its next chunk is ready; ``None``
        when it needs none: a chunk is ready, or it has finished (never known, by default: then
        no chunk waits for it)."""
        return None

    def check_codes(self, request: R, codes: Sequence[int], finished: bool) -> None:
        """``ValueError`` when ``codes`` cannot follow the request's (before they are taken)."""

    @abc.abstractmethod
    def width(self, chunk: W) -> int:
        """The chunk's window before padding, in the unit of ``windows``."""

    @abc.abstractmethod
    def pad(self, ready: Sequence[tuple[R, W]], rows: int, window: int) -> B:
        """``ready`` chunks in the first rows of a ``rows``-row solve whose windows pad to
        ``window``; the other rows are placeholders that neither fail nor yield NaN."""

    @abc.abstractmethod
    def program(self, batch: B) -> ProgramCall:
        """The compiled call that solves ``batch``."""

    @abc.abstractmethod
    def fetched(self, outputs: Any) -> H:
        """A solve's results on the host, from the outputs its :meth:`program` returned."""

    def decode(self, batch: B) -> H:
        """The solve of ``batch`` (its :meth:`program`), waited for, its results on the host."""
        return self.fetched(self.program(batch)())

    @abc.abstractmethod
    def emitted(self, solved: H, row: int, chunk: W) -> np.ndarray:
        """Row ``row``'s audio: the chunk's new samples."""

    @abc.abstractmethod
    def advance(self, request: R, chunk: W, solved: H, row: int) -> bool:
        """Move the request past its decoded ``chunk``; whether that was its last."""

    def _start(self, request: R) -> R:
        """Hold a new request (``ValueError`` when its id is already streaming)."""
        if request.request_id in self._requests:
            raise ValueError(f"request {request.request_id!r} is already streaming")
        self._requests[request.request_id] = request
        return request

    @property
    def num_streaming(self) -> int:
        """Requests added and not yet done: waiting for codes or with a chunk ready."""
        return len(self._requests)

    def extend(self, request_id: str, codes: Sequence[int], finished: bool = False) -> None:
        """Append ``codes`` to the request's; ``finished``: they were its last."""
        request = self._requests[request_id]
        if request.finished:
            raise ValueError(f"request {request_id!r} has already finished")
        self.check_codes(request, codes, finished)
        if finished and not request.codes and len(codes) == 0:
            raise ValueError(f"request {request_id!r} finished without a {self.unit} to voice")
        request.codes.extend(int(c) for c in codes)
        request.finished = finished

    def remove(self, request_id: str) -> bool:
        """Forget a request (aborted); ``False`` when it is not streaming. Its chunk in the solve
        in flight is dropped (nothing of it is read when the solve lands); a solve left with no
        request is forgotten at once (the device finishes it, nothing reads it)."""
        if self.in_flight is not None and not self.in_flight.drop(
            lambda pair: pair[0].request_id == request_id
        ):
            self.in_flight = None
        return self._requests.pop(request_id, None) is not None

    def ready(self) -> list[tuple[R, W]]:
        """Each request's next chunk when ready, oldest request first."""
        pairs = ((r, self.next_window(r)) for r in self._requests.values())
        return [(r, w) for r, w in pairs if w is not None]

    def has_work(self) -> bool:
        return self.in_flight is not None or any(
            self.drained(r) or self.next_window(r) is not None for r in self._requests.values()
        )

    def step(self, block: bool = True) -> list[StreamedChunk[W]]:
        """Requests that finished with nothing left to decode end (empty audio); the solve in
        flight lands (its chunks' audio), when the device has finished it or ``block``; then,
        with none in flight, one solve is dispatched: the next chunks of the oldest
        ``max_batch`` requests with one ready, unless they wait for others'
        (:meth:`gathering`), or the first of their :meth:`groups` when a shared solve would pay
        more in padding than a solve of their own costs. With ``block`` it lands in this step,
        unless one already did: then it is left in flight, so the audio that landed reaches the
        caller now, not after another solve (a request gets at most one chunk a step); without
        ``block``, in a later step (:attr:`in_flight` until then), so the caller's other work
        runs while the device solves."""
        now = self.clock()
        self._gap = 0.0 if self._last_step is None else max(0.0, now - self._last_step)
        self._last_step = now
        outputs: list[StreamedChunk[W]] = []
        for request in [r for r in self._requests.values() if self.drained(r)]:
            del self._requests[request.request_id]
            outputs.append(StreamedChunk(request.request_id, None, np.zeros(0, np.float32), True))
        if self.in_flight is not None:
            if not block and not self.in_flight.done():
                return outputs
            flight, self.in_flight = self.in_flight, None
            outputs += self.land(flight)
        ready = self.ready()[: self.max_batch]
        if not ready or self.gathering(ready):
            return outputs
        first = self.groups(ready)[0]
        if block and not outputs:
            return self.run(first)
        self.in_flight = self._dispatch(first)
        return outputs

    def groups(self, ready: Sequence[tuple[R, W]]) -> list[list[tuple[R, W]]]:
        """``ready`` chunks split into solves, most urgent first: sorted by padded window, cut
        where padding every chunk to a longer window (or rows to the next bucket) would cost
        more than one more solve (:meth:`SolveBuckets.split
        <omni_jax.engine.generation_runner.SolveBuckets.split>`, the offline runner's, with the
        overhead :class:`~omni_jax.engine.solve_cost.SolveCost` fits to this decoder's own
        timings: where a solve's rows are nearly free, as on an accelerator, it is one solve).
        The group holding a request's first chunk (its first audio) comes first, else the
        group of the oldest request."""
        split = self.buckets.split(range(len(ready)), lambda i: self.width(ready[i][1]), self.cost.overhead())
        groups = [sorted(group) for group in split]  # each in the requests' order
        urgent = min(range(len(ready)), key=lambda i: ready[i][0].done > 0)  # the oldest on a tie
        groups.sort(key=lambda group: urgent not in group)
        return [[ready[i] for i in group] for group in groups]

    def gathering(self, ready: Sequence[tuple[R, W]]) -> bool:
        """Whether the ``ready`` chunks wait this step for other requests' chunks, to share their
        solve. Only where that pays and no listener can hear it: the solve has room for more; one
        more solve costs at least a row of their window (the fitted overhead: where rows are
        nearly free, as on an accelerator); none is its request's first (its first audio) or of
        a request whose codes are all in (the rest of it is there to decode: a wait would only
        delay its end); another request's chunk is still coming (its codes arrive); and every
        one of their requests' audio still to play (:class:`Playback`) covers its last chunk's
        length and :data:`SLACK` times a whole solve and a step, so the chunk, solved next step
        at the latest, lands with a chunk's audio to spare. Requests a step or two apart (their
        talker prompts admitted in different steps) otherwise share a solve only by chance."""
        if len(ready) >= self.max_batch or any(r.done == 0 or r.finished for r, _ in ready):
            return False
        if self.cost.overhead() < max(self.width(chunk) for _, chunk in ready):
            return False
        waiting = {r.request_id for r, _ in ready}
        coming = (r for r in self._requests.values() if r.request_id not in waiting)
        if not any(self.short_of(r) is not None for r in coming):
            return False
        rows, window = self.buckets.largest()
        solve_s = self.cost.seconds(rows * window)
        if solve_s is None:
            return False
        now, margin = self.clock(), SLACK * (solve_s + self._gap)
        return all(r.played is not None and r.played.left(now) > r.played.last + margin for r, _ in ready)

    def run(self, ready: Sequence[tuple[R, W]]) -> list[StreamedChunk[W]]:
        """One padded solve of ``ready`` chunks, waited for, each request advanced by its chunk
        (:meth:`step` with ``block``; the failure rules are :meth:`land`'s)."""
        return self.land(self._dispatch(ready))

    def _dispatch(self, ready: Sequence[tuple[R, W]]) -> InFlight[tuple[R, W]]:
        """Pad ``ready`` chunks into the smallest ``(rows, window)`` that holds them and start
        their solve; nothing waits for the device here."""
        window = self.buckets.length_for(max(self.width(chunk) for _, chunk in ready))
        rows = self.buckets.rows_for(len(ready))
        batch = self.pad(ready, rows, window)
        return InFlight.dispatch(ready, (rows, window), lambda: self.program(batch)())

    def land(self, flight: InFlight[tuple[R, W]]) -> list[StreamedChunk[W]]:
        """A dispatched solve, waited for: each request still wanted advanced by its chunk (one
        aborted since the dispatch is not: :meth:`remove` dropped its row).

        As in :meth:`~omni_jax.engine.generation_runner.GenerationRunner.land`, a device failure
        is retried one request at a time and a row with non-finite audio fails alone: a failed
        request gets an ``error`` output and is forgotten, the others go on. A chunk's
        ``solve_s`` is :attr:`InFlight.seconds`.
        """
        ready = list(flight.rows.values())
        solved = flight.read(self.fetched)
        if isinstance(solved, jax.errors.JaxRuntimeError):
            if len(ready) > 1:
                return [out for pair in ready for out in self.run([pair])]
            return [self._fail(*pair, f"solve failed: {solved}", flight.seconds, 1) for pair in ready]
        dt = flight.seconds
        rows, window = flight.shape
        self.cost.record(flight.shape, rows * window, dt)
        outputs = []
        for i, (request, chunk) in flight.rows.items():
            audio = self.emitted(solved, i, chunk)
            if not np.isfinite(audio).all():
                bad = int((~np.isfinite(audio)).sum())
                message = f"non-finite waveform ({bad} of {audio.size} samples)"
                outputs.append(self._fail(request, chunk, message, dt, flight.size))
                continue
            last = self.advance(request, chunk, solved, i)
            request.done += 1
            if request.played is None:
                request.played = Playback(self.clock())
            request.played.add(audio.size / self.sample_rate)
            if last:
                del self._requests[request.request_id]
            outputs.append(StreamedChunk(request.request_id, chunk, audio.copy(), last, dt, flight.size))
        return outputs

    def _fail(self, request: R, chunk: W, error: str, solve_s: float, rows: int) -> StreamedChunk[W]:
        del self._requests[request.request_id]
        return StreamedChunk(request.request_id, chunk, np.zeros(0, np.float32), True, solve_s, rows, error)

    def warmup(self) -> int:
        """Compile the program of every ``(rows, window)``, side by side
        (:func:`compile_ahead`), then solve each once; returns how many."""
        shapes = self.buckets.shapes()
        compile_ahead([self.program(self.pad([], rows, window)) for rows, window in shapes])
        for rows, window in shapes:
            self.decode(self.pad([], rows, window))
        return len(shapes)
