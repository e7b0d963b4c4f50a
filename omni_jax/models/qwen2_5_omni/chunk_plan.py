"""Where streamed (chunked) code2wav cuts a request: the windows of Qwen's own streaming loop.

Pure host-side arithmetic, no arrays. The algorithm is the one of Qwen's vLLM fork
(``Qwen2Code2wav.process_chunk`` and ``process_chunk_for_50hz``, ported unchanged by vLLM-Omni):
a request's mel frames are cut into chunks of ``chunk`` new frames; chunk ``p`` is solved by
the DiT from noise on its window, ``past`` frames before it and ``future`` after it, and only
its own frames are kept. The window starts on the offline block grid, so every single DiT
evaluation sees the same blocks as offline; over the ODE's many evaluations the truncated
context still reaches the kept frames, so a streamed mel only approximates the offline one.
The kept mel is vocoded with the previous chunk's last ``2 * overlap`` kept frames before it
and ``overlap`` frames of audio are dropped at each inner edge (overlap-and-discard, no
crossfade), so every emitted sample had ``overlap`` frames of mel context on both sides.

The first chunk may be shorter (``first`` frames, capped at ``chunk``): it needs fewer codes
before it can run, so the first audio comes sooner (vLLM-omni does the same for Qwen3-Omni).
Later chunks may grow (``max_chunk``): chunk ``p >= 1`` keeps ``min(chunk * 2 ** (p - 1),
max_chunk)`` frames. Why: every chunk re-solves ``past + future`` frames of context, so Qwen's
fixed 72-frame chunks cost the DiT twice the offline work and the vocoder a prefix of
``2 * overlap`` frames a chunk; doubling chunks keep the first audio as early while the context
becomes a small share of the work. The cost is buffer margin: chunk ``p + 1`` needs about as
many new codes as all chunks before it voiced, so the talker must run faster than real time by
that factor for playback not to wait. With ``first == chunk`` and no ``max_chunk`` (the
defaults) the grid is the reference's.

A request of ``N`` mel frames is one chunk (a "little" request, ``N <= first + future``: the
offline solve) or several: chunk ``p`` is the last when ``N`` is at most its window's end
(its last kept frame plus ``future``). The split depends on ``N`` only, never on how the codes
arrived: chunk ``p`` is known not to be the last, and runs, once more frames exist than its
window's end (the reference runs it at exactly that many, so a request that then stops would
have a different split), or when the request has finished.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import TYPE_CHECKING

from omni_jax.chunk_growth import doubling, grown_size

if TYPE_CHECKING:
    from omni_jax.models.qwen2_5_omni.token2wav import Token2Wav

CHUNK_FRAMES = 72
"""New mel frames per chunk: three DiT blocks of Qwen2.5-Omni (vLLM-Omni's ``batched_chunk=3``,
the fork's class default)."""

PAST_FRAMES = 48
"""DiT context before a chunk: two blocks, what one evaluation's look-back layers reach."""

FUTURE_FRAMES = 24
"""DiT context after a chunk: one block, what one evaluation's look-ahead layer reaches."""

OVERLAP_FRAMES = 20
"""Vocoder context on each side of a chunk's emitted audio (the references' ``future_size``)."""


class ChunkKind(enum.Enum):
    """A chunk's place in its request, which decides what is kept and emitted."""

    LITTLE = "little"  # the only chunk: the offline solve, all of it emitted
    FIRST = "first"  # chunk 0 of several: no vocoder prefix, its last ``overlap`` frames held back
    MIDDLE = "middle"  # vocoder prefix before, ``overlap`` frames held back after
    FINAL = "final"  # the last of several: vocoder prefix before, emitted to the end


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One chunk of a request: what its solve reads and what of its audio is emitted.

    ``start, end``: its DiT window in the request's mel frames (``[start, end)``; codes
    ``[start // repeats, end // repeats)``, noise rows ``[start, end)``). ``keep_lo, keep_len``:
    the kept frames, relative to the window. ``prefix_len``: frames of the previous chunk's
    kept mel before them in the vocoder input (0 or ``2 * overlap``). ``emit_lo, emit_hi``: the
    emitted samples of the vocoder output; ``offset``: where they start in the request's audio.
    """

    index: int
    kind: ChunkKind
    start: int
    end: int
    keep_lo: int
    keep_len: int
    prefix_len: int
    emit_lo: int
    emit_hi: int
    offset: int

    @property
    def window(self) -> int:
        """Mel frames the DiT solves."""
        return self.end - self.start

    @property
    def vocoded(self) -> int:
        """Mel frames the vocoder reads: the prefix, then the kept frames."""
        return self.prefix_len + self.keep_len

    @property
    def emitted(self) -> int:
        """Samples this chunk adds to the request's audio."""
        return self.emit_hi - self.emit_lo


def _check_multiple(name: str, value: int, unit: int, what: str) -> None:
    if value % unit:
        raise ValueError(f"{name}={value} must be a multiple of the {what} ({unit})")


@dataclasses.dataclass(frozen=True)
class ChunkPlanner:
    """The streaming constants of a model and the chunks they cut a request into.

    Sizes are mel frames. From the model: ``repeats`` (mel frames per code), ``block_size`` (the
    DiT's attention block), ``look_backward_blocks`` / ``look_ahead_blocks`` (how many of its
    layers look one block back / ahead), ``hop`` (waveform samples per mel frame). Chosen:
    ``chunk``, ``past``, ``future`` (DiT), ``overlap`` (vocoder), Qwen's by default,
    ``first``, the first chunk's frames (``None``: ``chunk``; capped at ``chunk``), and
    ``max_chunk``, the most frames a later chunk grows to (``None``: ``chunk``, every later chunk
    the same). Raises ``ValueError`` naming the first constant that breaks the algorithm.
    """

    repeats: int
    block_size: int
    look_backward_blocks: int
    look_ahead_blocks: int
    hop: int
    chunk: int = CHUNK_FRAMES
    past: int = PAST_FRAMES
    future: int = FUTURE_FRAMES
    overlap: int = OVERLAP_FRAMES
    first: int | None = None
    max_chunk: int | None = None

    def __post_init__(self) -> None:
        for name in ("repeats", "block_size", "hop", "chunk", "first_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        for name in ("look_backward_blocks", "look_ahead_blocks", "past", "future", "overlap"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        if self.largest_chunk < self.chunk:
            raise ValueError(f"max_chunk={self.max_chunk} must be at least chunk={self.chunk}")
        grows = ("max_chunk",) if self.max_chunk is not None else ()
        for name in ("chunk", "first_chunk", *grows, "past", "future"):
            # Windows then start and end on the offline block grid and on whole codes.
            _check_multiple(name, getattr(self, name), self.block_size, "DiT's block_size")
            _check_multiple(name, getattr(self, name), self.repeats, "mel frames per code (repeats)")
        for name in ("chunk", "first_chunk"):
            if getattr(self, name) < 2 * self.overlap:
                raise ValueError(
                    f"{name}={getattr(self, name)} must be at least 2 * overlap={2 * self.overlap}: "
                    "the next chunk's vocoder prefix is this chunk's last 2 * overlap kept frames"
                )
        reach = self.look_backward_blocks * self.block_size
        if self.past < reach:
            raise ValueError(
                f"past={self.past} must cover the {self.look_backward_blocks} look-backward layers' "
                f"reach of {reach} frames"
            )
        reach = self.look_ahead_blocks * self.block_size
        if self.future < reach:
            raise ValueError(
                f"future={self.future} must cover the {self.look_ahead_blocks} look-ahead layers' "
                f"reach of {reach} frames"
            )

    @classmethod
    def for_model(cls, model: Token2Wav, **chosen: int) -> ChunkPlanner:
        """The constants of ``model`` (a ``Token2Wav``), with ``chosen`` ones (``chunk``, ``past``,
        ``future``, ``overlap``, ``first``, ``max_chunk``) in place of Qwen's. ``ValueError`` when
        the vocoder's output is not a whole number of samples per mel frame."""
        layers = [block.attn for block in model.dit.transformer_blocks]
        hop = math.prod(stride for stride, _, _ in model.bigvgan.upsample_geometry)
        for frames in (1, 2):
            if model.bigvgan.output_lengths(frames) != frames * hop:
                raise ValueError(
                    f"the vocoder makes {model.bigvgan.output_lengths(frames)} samples of {frames} "
                    f"mel frames, not {frames} x {hop}: its upsampling kernels do not suit streaming"
                )
        return cls(
            repeats=model.dit.repeats,
            block_size=layers[0].block_size,
            look_backward_blocks=sum(a.look_backward_block for a in layers),
            look_ahead_blocks=sum(a.look_ahead_block for a in layers),
            hop=hop,
            **chosen,
        )

    @property
    def first_chunk(self) -> int:
        """The first chunk's new frames: ``first``, never more than ``chunk`` (a stage or request
        that asks for a smaller chunk gets a first chunk no longer), or ``chunk`` when unset."""
        return self.chunk if self.first is None else min(self.first, self.chunk)

    @property
    def largest_chunk(self) -> int:
        """The most frames a chunk keeps before its last: ``max_chunk``, or ``chunk``."""
        return self.chunk if self.max_chunk is None else self.max_chunk

    @property
    def growing(self) -> list[int]:
        """The frames of chunks ``1, 2, ...`` while they are shorter than :attr:`largest_chunk`
        (empty when chunks do not grow); every later chunk is the largest."""
        return doubling(self.chunk, self.largest_chunk)

    def chunk_size(self, index: int) -> int:
        """The frames chunk ``index`` keeps when it is not the last."""
        return grown_size(index, self.first_chunk, self.chunk, self.largest_chunk)

    def chunk_start(self, index: int) -> int:
        """The first frame chunk ``index`` keeps: the sizes of the chunks before it."""
        if index == 0:
            return 0
        growing = self.growing
        grown = min(index - 1, len(growing))
        return self.first_chunk + sum(growing[:grown]) + (index - 1 - grown) * self.largest_chunk

    @property
    def window_frames(self) -> int:
        """The longest DiT window: a middle chunk's of the largest size."""
        return self.past + self.largest_chunk + self.future

    @property
    def first_window_frames(self) -> int:
        """The first chunk's DiT window (no past): shorter than a middle chunk's, so a solve of
        first chunks alone can run a smaller program."""
        return self.first_chunk + self.future

    @property
    def windows(self) -> list[int]:
        """The DiT windows a solve pads to, shortest first: the first chunk's and a middle chunk's
        of each size, so a solve of small chunks need not pay for the largest window."""
        middles = (self.past + size + self.future for size in [*self.growing, self.largest_chunk])
        return sorted({self.first_window_frames, *middles})

    @property
    def keep_frames(self) -> int:
        """The most frames a chunk keeps: a final (or little) chunk's ``largest_chunk + future``."""
        return self.largest_chunk + self.future

    def keep_bound(self, window: int) -> int:
        """The most frames a chunk whose DiT window pads to ``window`` keeps (its solve's static
        vocoder length): a first or little chunk up to its whole window, no more than the first
        chunk's; a later one all but the frames before its first kept frame, at least
        ``min(past, 2 * overlap)`` (its first kept frame is at or after the end of a first chunk,
        which is at least ``2 * overlap`` long, and the window starts ``past`` before it or at 0).
        Holds for a request's own planner too (:meth:`with_chunk`: the same context, a smaller
        chunk)."""
        later = min(window - min(self.past, 2 * self.overlap), self.keep_frames)
        return max(min(window, self.first_window_frames), later)

    @property
    def vocoder_frames(self) -> int:
        """The longest vocoder input: a prefix and the most kept frames."""
        return 2 * self.overlap + self.keep_frames

    def chunk_codes_rule(self) -> str:
        """What a chunk must be, in codes (the unit a request's ``chunk_codes`` is given in):
        whole DiT blocks of whole codes, and at least two vocoder overlaps."""
        step = math.lcm(self.block_size, self.repeats) // self.repeats
        least = math.ceil(2 * self.overlap / (step * self.repeats)) * step
        return (
            f"a multiple of {step} codes (whole DiT blocks) and at least {least} codes (two vocoder overlaps)"
        )

    def with_chunk(self, chunk: int) -> ChunkPlanner:
        """This planner with every chunk after the first ``chunk`` frames (none grow; the first
        no longer than them): a request's own ``chunk_codes``, which its caller keeps within
        :attr:`largest_chunk` (the windows here must hold it). ``ValueError`` when ``chunk``
        breaks the algorithm."""
        return dataclasses.replace(self, chunk=chunk, max_chunk=None)

    def codes_ready(self, index: int) -> int:
        """The codes with which chunk ``index`` runs before its request has finished: one more
        than its window's end holds (it is then known not to be the last)."""
        return (self.chunk_start(index + 1) + self.future) // self.repeats + 1

    def num_chunks(self, num_codes: int) -> int:
        """How many chunks a finished request of ``num_codes`` codes has."""
        return self._not_last(num_codes * self.repeats) + 1

    def _not_last(self, frames: int) -> int:
        """How many chunks are known not to be the last once ``frames`` frames exist: those
        whose window ends before them (chunk ``p``: ``chunk_start(p + 1) + future < frames``)."""
        rest = frames - self.future - self.first_chunk
        count, covered = 0, 0  # chunks counted, and the frames of chunks 1 .. count
        for size in self.growing:
            if covered >= rest:
                return count
            count, covered = count + 1, covered + size
        return count + max(0, math.ceil((rest - covered) / self.largest_chunk))

    def ready(self, num_codes: int, finished: bool, done: int = 0) -> list[Chunk]:
        """The chunks from index ``done`` on that can run with ``num_codes`` codes so far
        (``finished``: the request has all of them), in order. They depend on the final count
        only: a chunk is returned once it is known whether it is the last."""
        if finished and num_codes < 1:
            raise ValueError("a finished request needs at least one code to voice")
        frames = num_codes * self.repeats
        count = self._not_last(frames) + (1 if finished else 0)
        return [self.chunk_of(p, frames, finished and p == count - 1) for p in range(done, count)]

    def split(self, num_codes: int) -> list[Chunk]:
        """Every chunk of a finished request of ``num_codes`` codes."""
        return self.ready(num_codes, finished=True)

    def chunk_of(self, index: int, frames: int, final: bool) -> Chunk:
        """Chunk ``index`` of a request; ``final`` when it is the last, of ``frames`` frames."""
        c, v, hop = self.chunk_size(index), self.overlap, self.hop
        lo = self.chunk_start(index)  # the chunk's first kept frame
        start = max(lo - self.past, 0)
        end = frames if final else lo + c + self.future
        keep_len = end - lo if final else c
        prefix_len = 0 if index == 0 else 2 * v
        vocoded = prefix_len + keep_len
        if index == 0:
            kind = ChunkKind.LITTLE if final else ChunkKind.FIRST
        else:
            kind = ChunkKind.FINAL if final else ChunkKind.MIDDLE
        return Chunk(
            index=index,
            kind=kind,
            start=start,
            end=end,
            keep_lo=lo - start,
            keep_len=keep_len,
            prefix_len=prefix_len,
            emit_lo=0 if index == 0 else v * hop,
            emit_hi=(vocoded if final else vocoded - v) * hop,
            offset=0 if index == 0 else (lo - v) * hop,
        )
