"""An open-loop load generator for OpenAI-compatible chat servers (as vLLM's ``benchmark_serving``).

Request ``i`` is sent at its arrival time whatever became of the earlier ones: the arrivals are a
Poisson process, seeded exponential gaps of mean ``1 / rate``. The gaps are one seeded draw of
unit exponentials divided by the rate, so every rate runs the same pattern of arrivals, only
compressed or stretched in time, and two rates differ in their load alone. Each request streams
(SSE, ``stream_options.include_usage``) and is recorded as it comes back (:class:`Record`):

- TTFT: from sending to the first chunk with non-empty ``delta.content``;
- TPOT: ``(last content chunk - first content chunk) / (completion tokens - 1)``, the tokens
  counted from the usage chunk (a chunk may carry several tokens' text, or a token none);
- TTFA: from sending to the first chunk with ``delta.audio.data`` (a spoken reply's text chunks carry
  ``delta.audio`` too, with its transcript alone);
- e2e: from sending to ``[DONE]``;
- audio seconds: each audio chunk is a WAV file of its own (OpenAI's ``"wav"`` format), its
  frames over its rate.

:func:`summarize` turns one run's records into the figures per run: completed requests per
second and output tokens per second over the run's wall time (first send to last end), p50 /
p90 / p99 (and mean) of each latency, and the audio's real-time factor both ways (audio seconds
produced per wall second; each request's audio seconds over its e2e seconds).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import json
import time
import wave
from collections.abc import Sequence
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """``n`` arrival offsets in seconds, the first at 0: seeded unit exponential gaps over ``rate``
    (``inf``: all at once)."""
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    gaps = np.random.default_rng(seed).exponential(1.0, size=max(n - 1, 0))
    if np.isinf(rate):
        return [0.0] * n
    return [0.0, *np.cumsum(gaps / rate).tolist()]


@dataclasses.dataclass
class Record:
    """One request as the client saw it; times in seconds, ``sent_s`` from the run's start, the
    others from sending it. ``status``: ``"ok"``, or what went wrong (an HTTP status, an ``error``
    event, an exception)."""

    index: int
    scheduled_s: float
    sent_s: float = 0.0
    status: str = "pending"
    ttft_s: float | None = None
    tpot_s: float | None = None
    ttfa_s: float | None = None
    e2e_s: float | None = None
    first_chunk_s: float | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    content_chunks: int = 0
    audio_chunks: int = 0
    audio_s: float = 0.0
    finish_reason: str | None = None
    text: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def as_dict(self) -> dict[str, Any]:
        """The record without its text (the suite compares texts, the JSON keeps figures)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "text"}


def wav_seconds(data_b64: str) -> float:
    """The length of a base64 WAV file in seconds."""
    with wave.open(io.BytesIO(base64.b64decode(data_b64))) as w:
        return w.getnframes() / w.getframerate()


async def stream_chat(client: Any, url: str, body: dict[str, Any], record: Record, t0: float) -> Record:
    """Send ``body`` (``stream`` and ``stream_options`` are set here) and fill ``record`` from the
    reply's SSE chunks. ``t0``: the run's start (``time.perf_counter()``)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    record.sent_s = start - t0
    first_content = last_content = None
    text: list[str] = []
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")[:300]
                record.status = f"http {resp.status_code}: {detail}"
                return record
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                now = time.perf_counter() - start
                if data == "[DONE]":
                    record.e2e_s = now
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    record.status = f"error event: {chunk['error'].get('message')}"
                    return record
                if record.first_chunk_s is None:
                    record.first_chunk_s = now
                if chunk.get("usage"):
                    record.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    record.output_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    delta = choice.get("delta") or {}
                    if delta.get("content"):
                        text.append(delta["content"])
                        record.content_chunks += 1
                        first_content = now if first_content is None else first_content
                        last_content = now
                    if delta.get("audio") and delta["audio"].get("data"):
                        record.audio_chunks += 1
                        record.audio_s += wav_seconds(delta["audio"]["data"])
                        record.ttfa_s = now if record.ttfa_s is None else record.ttfa_s
                    if choice.get("finish_reason"):
                        record.finish_reason = choice["finish_reason"]
    except Exception as e:  # noqa: BLE001 - a failed request is a figure, not the run's end
        record.status = f"exception: {e!r}"
        return record
    record.text = "".join(text)
    if record.e2e_s is None:
        record.status = "stream ended without [DONE]"
        return record
    if record.output_tokens is None:
        record.status = "no usage chunk"
        return record
    record.ttft_s = first_content
    if first_content is not None and record.output_tokens > 1:
        record.tpot_s = (last_content - first_content) / (record.output_tokens - 1)
    record.status = "ok"
    return record


def _client() -> Any:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits)


async def _open_loop(url: str, bodies: Sequence[dict[str, Any]], arrivals: Sequence[float]) -> list[Record]:
    async with _client() as client:
        t0 = time.perf_counter()
        tasks = []
        for i, (body, at) in enumerate(zip(bodies, arrivals, strict=True)):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(stream_chat(client, url, body, Record(i, at), t0)))
        return list(await asyncio.gather(*tasks))


async def _one_at_a_time(url: str, bodies: Sequence[dict[str, Any]]) -> list[Record]:
    async with _client() as client:
        t0 = time.perf_counter()
        records = []
        for i, body in enumerate(bodies):
            records.append(await stream_chat(client, url, body, Record(i, time.perf_counter() - t0), t0))
        return records


def open_loop(url: str, bodies: Sequence[dict[str, Any]], rate: float, seed: int = 0) -> list[Record]:
    """Every body sent at its Poisson arrival at ``rate`` requests per second, in order."""
    return asyncio.run(_open_loop(url, bodies, poisson_arrivals(len(bodies), rate, seed)))


def one_at_a_time(url: str, bodies: Sequence[dict[str, Any]]) -> list[Record]:
    """Each body sent when the previous one has ended (a closed loop of one: unloaded latency)."""
    return asyncio.run(_one_at_a_time(url, bodies))


def _stats(values: Sequence[float | None]) -> dict[str, float] | None:
    v = [x for x in values if x is not None]
    if not v:
        return None
    out = {f"p{p}": float(np.percentile(v, p)) for p in PERCENTILES}
    out["mean"] = float(np.mean(v))
    return out


def summarize(records: Sequence[Record]) -> dict[str, Any]:
    """One run's figures (module docstring); failed requests are counted and left out of the rest."""
    ok = [r for r in records if r.ok]
    if ok:
        start = min(r.sent_s for r in records)
        wall = max(r.sent_s + r.e2e_s for r in ok) - start
    else:
        wall = 0.0
    tokens = sum(r.output_tokens for r in ok)
    audio = sum(r.audio_s for r in ok)
    out: dict[str, Any] = {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "failures": sorted({r.status for r in records if not r.ok}),
        "wall_s": wall,
        "requests_per_s": len(ok) / wall if wall > 0 else 0.0,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "ttft_s": _stats([r.ttft_s for r in ok]),
        "tpot_s": _stats([r.tpot_s for r in ok]),
        "e2e_s": _stats([r.e2e_s for r in ok]),
        "ttfa_s": _stats([r.ttfa_s for r in ok]),
        "audio_s": audio,
        "audio_s_per_wall_s": audio / wall if wall > 0 else 0.0,
        "audio_rtf_per_request": _stats([r.audio_s / r.e2e_s for r in ok if r.audio_s > 0]),
    }
    return out


def parse_rates(text: str) -> list[float]:
    """``"0.5,1,2"`` -> ``[0.5, 1.0, 2.0]`` (positive, sorted, without repeats): ``--rates``."""
    import argparse

    try:
        rates = sorted({float(s) for s in text.split(",") if s.strip()})
    except ValueError:
        rates = []
    if not rates or rates[0] <= 0 or not all(np.isfinite(rates)):
        raise argparse.ArgumentTypeError(f"{text!r}: positive numbers, e.g. 0.5,1,2")
    return rates
