"""The serve suite's reference: transformers behind the same HTTP layer, one request at a time.

``python -m benchmarks.reference_server PATH --port P [--served-model-name NAME] [--dtype D]
[--talker-max-tokens N --num-steps S --guidance-scale G]``: what a user has without omni_jax, a
FastAPI + uvicorn server with OpenAI's chat-completions request and response JSON and the same
SSE framing as ``omni-jax serve`` (a role chunk when the first token is out, ``delta.content``
chunks, ``delta.audio`` chunks, the finish chunk, the usage chunk, ``[DONE]``; errors, events and
WAV encoded by ours, :mod:`omni_jax.serve.responses`), and ``/health`` (200 once the model is
loaded).

The model is loaded as transformers loads it (float32 unless ``--dtype``): ``Qwen2ForCausalLM``
for a ``qwen2`` checkpoint, ``Qwen2_5OmniForConditionalGeneration`` for a ``qwen2_5_omni`` one.
Requests are served one at a time, in arrival order (an ``asyncio.Lock``, which is FIFO); the
others wait. Each runs ``generate`` in a worker thread, greedy, with the request's ``max_tokens``
and ``min_tokens`` (``min_new_tokens``), streaming token by token: a streamer hands each new token
to the event loop and the text is sent as soon as it decodes to whole characters, as ours is
(transformers' ``TextIteratorStreamer`` holds text back until a word ends, which would delay the
reference's first token and bunch its deltas). For Qwen2.5-Omni with ``modalities`` holding
``"audio"``, the thinker's text streams the same way (``generate``'s ``thinker_streamer``) and
the audio comes whole, one WAV chunk at the end, when ``generate`` returns: transformers does not
stream the talker or token2wav. The talker is greedy with repetition penalty 1.05 (as the serve
suite configures ours), at most ``--talker-max-tokens`` codes, stopping on codec EOS or pad, and
token2wav runs ``--num-steps`` / ``--guidance-scale``; the prompt carries one masked left pad
column, so the talker takes the path it was trained on (``benchmarks/e2e_suite.py`` explains).
Only text content and greedy decoding are served (``temperature`` 0 or unset; ``repetition_penalty``
too, vLLM's extension, which ours serves); anything else is refused with a 400.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import os
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from omni_jax.cli_errors import plain_text
from omni_jax.serve.responses import audio_data, error_json, sse

SAMPLE_RATE = 24_000
"""Qwen2.5-Omni's token2wav output rate."""
REPETITION_PENALTY = 1.05


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]


class AudioOutput(_Strict):
    voice: str
    format: Literal["wav"] = "wav"


class StreamOptions(_Strict):
    include_usage: bool = False


class ChatRequest(_Strict):
    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    min_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0.0, le=0.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    audio: AudioOutput | None = None


class _Tokens:
    """A ``generate`` streamer: its first ``put`` is the prompt (skipped), each later one the new
    token, handed to ``on_token`` (from the worker thread)."""

    def __init__(self, on_token: Any):
        self.on_token = on_token
        self.prompt_seen = False

    def put(self, value: Any) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        for t in value.reshape(-1).tolist():
            self.on_token(int(t))

    def end(self) -> None:
        pass


class Engine:
    """The transformers model and how one request runs on it (in a worker thread)."""

    def __init__(
        self, path: Path, dtype: str | None, talker_max_tokens: int, num_steps: int, guidance: float
    ):
        import torch
        from transformers import AutoTokenizer

        self.torch = torch
        kind = json.loads((path / "config.json").read_text()).get("model_type")
        self.omni = kind == "qwen2_5_omni"
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        dt = getattr(torch, dtype or "float32")
        if self.omni:
            from transformers import Qwen2_5OmniForConditionalGeneration

            self.model = Qwen2_5OmniForConditionalGeneration.from_pretrained(str(path), dtype=dt).eval()
            m = self.model
            self.eos = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
            self.codec_stops = [m.talker.codec_pad_token, m.talker.codec_eos_token]
            token2wav = m.token2wav.forward

            def voice(code: Any, *args: Any, **kwargs: Any) -> Any:
                # A talker that stops on its first code leaves nothing to voice (token2wav fails
                # on no codes): no audio, as ours.
                return token2wav(code, *args, **kwargs) if code.shape[-1] else torch.zeros(0)

            m.token2wav.forward = voice
        elif kind == "qwen2":
            from transformers import Qwen2ForCausalLM

            self.model = Qwen2ForCausalLM.from_pretrained(str(path), dtype=dt).eval()
        else:
            raise SystemExit(f"{path}: model_type {kind!r}; the reference serves qwen2 and qwen2_5_omni")
        self.pad = self.tokenizer.pad_token_id or 0
        self.talker_max_tokens = talker_max_tokens
        self.num_steps = num_steps
        self.guidance = guidance

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(self.tokenizer(text)["input_ids"])

    def run(self, job: Job) -> None:
        """The request, start to end: ``job`` gets ("token", id) events, then ("audio", samples)
        for a spoken reply, then ("end", prompt tokens, completion tokens), or ("error", text)."""
        torch = self.torch
        try:
            ids = self.prompt_ids(job.messages)
            count = 0

            def on_token(t: int) -> None:
                nonlocal count
                count += 1
                job.emit(("token", t))

            streamer = _Tokens(on_token)
            greedy = {"do_sample": False, "max_new_tokens": job.max_tokens, "min_new_tokens": job.min_tokens}
            if job.repetition_penalty is not None:
                greedy["repetition_penalty"] = job.repetition_penalty
            with torch.no_grad():
                if not self.omni:
                    x = torch.tensor([ids])
                    self.model.generate(
                        x,
                        attention_mask=torch.ones_like(x),
                        pad_token_id=self.pad,
                        streamer=streamer,
                        **greedy,
                    )
                else:
                    x = torch.tensor([[self.pad, *ids]])  # one masked pad column (module docstring)
                    mask = torch.tensor([[0] + [1] * len(ids)])
                    kwargs = {f"thinker_{k}": v for k, v in greedy.items()}
                    out = self.model.generate(
                        input_ids=x,
                        attention_mask=mask,
                        speaker=job.voice or next(iter(self.model.speaker_map)),
                        generation_mode="audio" if job.voice is not None else "text",
                        thinker_streamer=streamer,
                        thinker_eos_token_id=self.eos,
                        thinker_pad_token_id=self.pad,
                        talker_max_new_tokens=self.talker_max_tokens,
                        talker_do_sample=False,
                        talker_repetition_penalty=REPETITION_PENALTY,
                        talker_eos_token_id=self.codec_stops,
                        token2wav_num_steps=self.num_steps,
                        token2wav_guidance_scale=self.guidance,
                        token2wav_sway_coefficient=-1.0,
                        **kwargs,
                    )
                    if job.voice is not None:
                        wave_ = out[1]
                        samples = (wave_[0] if isinstance(wave_, list) else wave_).float().reshape(-1).numpy()
                        if samples.size:
                            job.emit(("audio", samples))
            job.emit(("end", len(ids), count))
        except Exception as e:  # noqa: BLE001 - the request fails, the server goes on
            job.emit(("error", repr(e)))


class Job:
    """One request's parameters and the queue its events reach the event loop through."""

    def __init__(self, loop: asyncio.AbstractEventLoop, request: ChatRequest, default_max: int):
        self.loop = loop
        self.queue: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()
        self.messages = [
            {
                "role": "system" if m.role == "developer" else m.role,
                "content": m.content if isinstance(m.content, str) else "".join(p.text for p in m.content),
            }
            for m in request.messages
        ]
        self.max_tokens = request.max_completion_tokens or request.max_tokens or default_max
        self.min_tokens = min(request.min_tokens or 0, self.max_tokens)
        self.repetition_penalty = request.repetition_penalty
        modalities = request.modalities or (["text", "audio"] if request.audio is not None else ["text"])
        self.voice = (request.audio.voice if request.audio else "Chelsie") if "audio" in modalities else None
        # (the stage YAML's default voice, as ours)

    def emit(self, event: tuple[Any, ...]) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)


class TextDeltas:
    """The reply's text as its tokens come: the whole reply decoded each time, the new part sent
    once it no longer ends in an incomplete character (concatenated, the deltas are the reply
    decoded at once, skipping special tokens, as ours)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.sent = ""

    def add(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd") or not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta

    def finish(self) -> str:
        """The rest of the reply decoded whole: text held back as incomplete at its end."""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        rest = text[len(self.sent) :] if text.startswith(self.sent) else ""
        self.sent += rest
        return rest


def build_app(engine: Engine, model_name: str, default_max: int = 64) -> FastAPI:
    lock = asyncio.Lock()
    worker = concurrent.futures.ThreadPoolExecutor(max_workers=1)

    @contextlib.asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        yield
        worker.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="transformers reference", lifespan=lifespan)

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        try:
            parsed = ChatRequest.model_validate_json(await request.body())
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            return JSONResponse(error_json(400, f"{where}: {first['msg']}"), status_code=400)
        if parsed.model != model_name:
            return JSONResponse(error_json(404, f"the model {parsed.model!r} does not exist here"), 404)
        loop = asyncio.get_running_loop()
        job = Job(loop, parsed, default_max)
        if job.voice is not None and not engine.omni:
            return JSONResponse(error_json(400, "this model writes text only"), status_code=400)
        await lock.acquire()  # one request at a time, in arrival order
        try:
            done = loop.run_in_executor(worker, engine.run, job)
        except BaseException:
            lock.release()
            raise
        done.add_done_callback(lambda _: lock.release())
        first = await job.queue.get()  # the first token (or the end): then the response starts
        if first[0] == "error":
            return JSONResponse(error_json(500, f"the request failed: {first[1]}"), status_code=500)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        deltas = TextDeltas(engine.tokenizer)

        def chunk(
            delta: dict[str, Any] | None, finish: str | None = None, usage: Any = None
        ) -> dict[str, Any]:
            choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
            out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name}
            out["choices"] = choices
            if usage is not None:
                out["usage"] = usage
            return out

        def usage_of(end: tuple[Any, ...]) -> dict[str, int]:
            return {"prompt_tokens": end[1], "completion_tokens": end[2], "total_tokens": end[1] + end[2]}

        def finish_of(end: tuple[Any, ...]) -> str:
            return "length" if end[2] >= job.max_tokens else "stop"

        async def events() -> AsyncIterator[tuple[Any, ...]]:
            event = first
            while True:
                yield event
                if event[0] in ("end", "error"):
                    return
                event = await job.queue.get()

        if not parsed.stream:
            text, audio, end = [], [], None
            async for event in events():
                if event[0] == "token":
                    text.append(deltas.add(event[1]))
                elif event[0] == "audio":
                    audio.append(event[1])
                elif event[0] == "error":
                    return JSONResponse(error_json(500, f"the request failed: {event[1]}"), status_code=500)
                else:
                    end = event
                    text.append(deltas.finish())
            message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
            if audio:
                data = audio_data(np.concatenate(audio), SAMPLE_RATE, "wav")
                message["audio"] = {"id": f"audio-{rid}", "data": data, "transcript": message["content"]}
            body = {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": model_name,
                "choices": [{"index": 0, "message": message, "finish_reason": finish_of(end)}],
                "usage": usage_of(end),
            }
            return JSONResponse(body)

        include_usage = parsed.stream_options is not None and parsed.stream_options.include_usage

        async def stream() -> AsyncIterator[bytes]:
            yield sse(chunk({"role": "assistant", "content": ""}))
            async for event in events():
                if event[0] == "token":
                    if text := deltas.add(event[1]):
                        yield sse(chunk({"content": text}))
                elif event[0] == "audio":
                    audio = {
                        "id": f"audio-{rid}",
                        "data": audio_data(event[1], SAMPLE_RATE, "wav"),
                        "transcript": "",
                    }
                    yield sse(chunk({"audio": audio}))
                elif event[0] == "error":
                    yield sse(error_json(500, f"the request failed: {event[1]}"))
                    yield sse("[DONE]")
                    return
                else:
                    if text := deltas.finish():
                        yield sse(chunk({"content": text}))
                    yield sse(chunk({}, finish_of(event)))
                    if include_usage:
                        yield sse(chunk(None, usage=usage_of(event)))
            yield sse("[DONE]")

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.reference_server", description=plain_text(__doc__))
    p.add_argument("model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    p.add_argument("--talker-max-tokens", type=int, default=128)
    p.add_argument("--num-steps", type=int, default=10)
    p.add_argument("--guidance-scale", type=float, default=0.5)
    args = p.parse_args(argv)
    import torch
    import uvicorn

    # As many intra-op threads as XLA uses on our side: the cores this process may run on.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(cores)
    engine = Engine(Path(args.model), args.dtype, args.talker_max_tokens, args.num_steps, args.guidance_scale)
    app = build_app(engine, args.served_model_name or args.model)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
