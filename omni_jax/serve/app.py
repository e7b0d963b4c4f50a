"""The OpenAI-compatible HTTP server over an :class:`AsyncOmniJaxPipeline` (FastAPI).

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models`` (and one model's
card, ``GET /v1/models/{model}``), ``GET /health`` (and ``HEAD``, and vLLM's ``/ping``),
``GET /version``, ``GET /metrics``, and vLLM's ``POST /tokenize`` and ``POST /detokenize``. A
request is checked in
this order, and refused with OpenAI's error JSON at the first problem: API key (401), warm (503),
a body that is not JSON by its ``Content-Type`` (415), body size (413), schema (400, naming the
field), model name (404), what the server cannot serve
(400), queue (429), then the stages' own admission (400, with their message). Only then does a
response start, so a streamed reply's 200 means the request is running. A client that disconnects
aborts its request (its KV pages and solve slot are freed at once); a fault in one request ends it
alone, with a 500 (or an ``error`` event in its stream), and the server goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from omni_jax import ParamError, __version__
from omni_jax.async_pipeline import AsyncOmniJaxPipeline, QueueFullError
from omni_jax.image_io import ImageItemError
from omni_jax.serve import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_IMAGE_PIXELS,
    convert,
    fanout,
    logprobs,
    media,
    responses,
)
from omni_jax.serve.metrics import ServeMetrics
from omni_jax.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    FieldError,
    ProcessorKwargs,
    TokenizeRequest,
    invalid_request_message,
)
from omni_jax.serve.reply import End, Piece, Usage, reply
from omni_jax.serve.transcripts import Transcripts
from omni_jax.voices import UnknownSpeakerError

log = logging.getLogger("omni_jax.serve")

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

CLIENT_GONE = 499
"""The status logged for a request whose client disconnected first (nginx's convention; the
client reads nothing)."""
REQUEST_ID_STATE = "omni_jax_request_id"
"""The key of a request's id in its ASGI scope's ``state`` (the app's log of a stream cut short
reads it there)."""
RETRY_QUEUE_S = 1
"""``Retry-After`` of a 429: a queue place frees as soon as a request ends."""
RETRY_WARMING_S = 10
"""``Retry-After`` of a 503 while the server warms up (compiling takes minutes)."""


@dataclasses.dataclass(frozen=True)
class ServeSettings:
    """``model_name``: what clients put in ``model``; ``api_key``: required as a bearer token on
    ``/v1`` routes when set; ``allowed_media``: the folder ``file://`` media URLs may be read
    from (``None``: none); ``max_image_pixels``: the most pixels a request's images may decode
    to together (``None``: no limit); ``warmup``: compile every program before ``/health`` turns 200;
    ``allowed_origins``: the web origins whose pages a browser lets call the server (CORS;
    ``"*"``: any). None by default, unlike vLLM's ``*``: a server on a laptop's loopback
    without a key would otherwise answer any web page its user opens. ``mm_processor_kwargs``:
    every chat request's, where the request does not set its own (vLLM's
    ``--mm-processor-kwargs``)."""

    model_name: str
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    allowed_media: Path | None = None
    max_image_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS
    warmup: bool = True
    allowed_origins: tuple[str, ...] = ()
    mm_processor_kwargs: ProcessorKwargs | None = None

    def media_reader(self) -> media.MediaReader:
        """A reader for one request's media."""
        return media.MediaReader(self.allowed_media, self.max_image_pixels)


class HTTPError(Exception):
    """A refusal: the status and the message of its OpenAI error JSON; ``retry_after``: seconds
    a client should wait before trying again (the ``Retry-After`` header of a 429 or a 503,
    which OpenAI's clients honour in their retries)."""

    def __init__(self, status: int, message: str, param: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.retry_after = retry_after


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the request's body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Server:
    """The app's state: the pipeline, its settings and metrics, and whether it is warm."""

    def __init__(self, pipe: AsyncOmniJaxPipeline, settings: ServeSettings):
        self.pipe = pipe
        self.settings = settings
        self.transcripts = Transcripts()
        self.metrics = ServeMetrics(lambda: pipe.stats, lambda: pipe.waiting, lambda: pipe.xla_compilations)
        self.ready = not settings.warmup
        self.warmup_error: str | None = None
        self.created = int(time.time())

    async def warm(self) -> None:
        """Compile every program before ``/health`` turns 200. A real checkpoint's warm-up is
        minutes on a GPU: a line says it started, and the warm-up bar (stderr) names the stage
        compiling and counts its programs, so a silent server is not taken for a hung one."""
        stages = [s.config.name for s in self.pipe.pipeline.stages]
        log.info(
            "warming up %s: compiling every program they can need; /health answers 503 until done", stages
        )
        try:
            report = await self.pipe.warmup(progress=True)
        except Exception as e:  # noqa: BLE001 - the server stays up, unhealthy, and says why
            log.exception("warm-up failed; /health stays 503")
            self.warmup_error = f"warm-up failed: {e!r}"
            return
        per_stage = ", ".join(
            f"{n}: {s.programs} programs in {s.seconds:.1f} s" for n, s in report.stages.items()
        )
        # A program built already in this process (the same function and shapes) counts in
        # ``programs`` but is neither compiled nor loaded again.
        shared = report.programs - report.compiles - report.loads
        log.info(
            "warm-up compiled %d programs (%d XLA compilations, %d loaded from the cache%s): %s",
            report.programs,
            report.compiles,
            report.loads,
            f", {shared} built already" if shared > 0 else "",
            per_stage,
        )
        self.ready = True

    # -- checks, in order ---------------------------------------------------------------
    def authorize(self, request: Request) -> None:
        key = self.settings.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise HTTPError(401, "a valid API key is required: send 'Authorization: Bearer <key>'")

    def require_ready(self) -> None:
        if not self.pipe.running:
            raise HTTPError(503, "the engine has stopped")
        if not self.ready:
            if self.warmup_error:
                raise HTTPError(503, self.warmup_error)
            raise HTTPError(
                503, "the server is warming up (compiling); retry shortly", retry_after=RETRY_WARMING_S
            )

    async def body(self, request: Request) -> bytes:
        limit = self.settings.max_body_bytes
        too_large = HTTPError(413, f"the request body is larger than the server's limit of {limit} bytes")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_large
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large
                chunks.append(chunk)
        except ClientDisconnect:
            raise HTTPError(CLIENT_GONE, "the client disconnected before sending its whole body") from None
        return b"".join(chunks)

    def parse(self, schema: type[M], body: bytes) -> M:
        try:
            parsed = schema.model_validate_json(body)
        except ValidationError as e:
            message, param = invalid_request_message(e)
            raise HTTPError(400, message, param) from None
        if parsed.model not in (None, self.settings.model_name):  # type: ignore[attr-defined]
            raise HTTPError(404, f"the model {parsed.model!r} does not exist here", "model")  # type: ignore[attr-defined]
        return parsed

    async def admit(self, request: Request, schema: type[M]) -> M:
        """The checks before a request is converted: key, warm, content type, body size, schema,
        model. The body is parsed in a worker thread: a large one takes seconds to validate, which
        on the event loop would hold up every other request's stream."""
        self.authorize(request)
        self.require_ready()
        _require_json(request)
        body = await self.body(request)
        return await asyncio.to_thread(self.parse, schema, body)

    async def respond(
        self,
        request: Request,
        serve: convert.ServeRequest,
        request_id: str,
        stream: Callable[[AsyncIterator[tuple[int, Piece | End]]], AsyncIterator[bytes]],
        choice: Callable[[int, fanout.Gathered], dict[str, Any]],
        whole: Callable[[list[dict[str, Any]], Usage], dict[str, Any]],
    ) -> Response:
        """Run the request's choices: their queue and admission checks, then an SSE response
        from ``stream(events)``, or the JSON ``whole(choices, usage)`` of each reply's
        ``choice(index, reply)``. A client gone before the end gets nothing (499 in the log); a
        request a stage failed is a 500."""
        self.check_room(serve.replies)
        setattr(request.state, REQUEST_ID_STATE, request_id)  # for the log of a stream cut short
        choices = serve.choices()
        ids = [request_id] if serve.replies == 1 else [f"{request_id}-{i}" for i in range(serve.replies)]
        arrival = time.perf_counter()
        admitted = [asyncio.Event() for _ in choices]
        replies = [
            reply(self.pipe, c, rid, self.metrics, arrival, signal)
            for c, rid, signal in zip(choices, ids, admitted, strict=True)
        ]
        try:
            first = await self.unless_disconnected(request, request_id, fanout.admit(replies, admitted))
        except fanout.Refused as refused:
            raise _refusal(refused, serve) from None
        if first is None:  # admit ended what it had started
            return Response(status_code=CLIENT_GONE)
        if serve.stream:
            return StreamingResponse(stream(fanout.merged(replies, first)), media_type="text/event-stream")
        gathered = await self.unless_disconnected(request, request_id, fanout.gathered(replies, first))
        if gathered is None:  # gathering cut, perhaps before it began: end what admit started
            await fanout.end(first, replies)
            return Response(status_code=CLIENT_GONE)
        failed = next((g for g in gathered if g.end.finish_reason == "error"), None)
        if failed is not None:
            raise HTTPError(500, _failed(serve, failed.index, failed.end))
        usage = fanout.total_usage({g.index: g.end for g in gathered}, serve.n)
        return JSONResponse(whole([choice(g.index, g) for g in gathered], usage))

    def check_room(self, replies: int) -> None:
        """A request of more replies than the first stage runs at once and ``--max-queue`` lets
        wait can never be admitted whole: a 400 naming ``n``, not a 429 a client would retry."""
        capacity, queue = self.pipe.stats.first.capacity, self.pipe.max_waiting
        if replies > 1 and capacity is not None and queue is not None and replies > capacity + queue:
            raise HTTPError(
                400,
                f"{replies} replies (n times the prompts) can never be admitted at once: the first stage "
                f"runs {capacity} and --max-queue lets {queue} wait",
                "n",
            )

    async def unless_disconnected(self, request: Request, request_id: str, work: Awaitable[T]) -> T | None:
        """``await work``, or cancel it and return ``None`` if the client disconnects first."""
        task = asyncio.ensure_future(work)
        watch = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # cut by the shutdown's timeout: the request goes with it
            task.cancel()
            raise
        finally:
            watch.cancel()
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        _log_aborted(request_id)
        return None


CLIENT_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,256}")
"""What an ``X-Request-Id`` header may hold: 1 to 256 visible ASCII characters."""


def _request_ids(request: Request, kind: str) -> tuple[str, str]:
    """``(reply id, engine id)``. The reply's id is ``kind-`` and the client's ``X-Request-Id``
    header when it sends one (as vLLM's server: a caller's own id follows its request into the
    reply and the log), else a random one; a 400 for a header :data:`CLIENT_REQUEST_ID`
    refuses. The engine's id is the reply's, made unique with a random suffix when the client
    chose it: a client may reuse its ids, even for requests still running."""
    given = request.headers.get("x-request-id")
    if given is None:
        reply_id = f"{kind}-{uuid.uuid4().hex}"
        return reply_id, reply_id
    if not CLIENT_REQUEST_ID.fullmatch(given):
        raise HTTPError(400, "X-Request-Id must be 1 to 256 visible ASCII characters")
    return f"{kind}-{given}", f"{kind}-{given}-{uuid.uuid4().hex[:12]}"


def _require_json(request: Request) -> None:
    """415 unless the body says it is JSON (``application/json`` or ``application/*+json``) or
    says nothing, as FastAPI reads a JSON body. A browser sends a form or plain text to another
    site without asking it first (no CORS preflight), so reading those as JSON would let any web
    page its user opens make a keyless local server generate."""
    given = request.headers.get("content-type")
    if given is None:
        return
    kind = given.split(";", 1)[0].strip().lower()
    family, _, subtype = kind.partition("/")
    if kind != "application/json" and not (family == "application" and subtype.endswith("+json")):
        raise HTTPError(415, f"the request body must be JSON (Content-Type: application/json), not {given!r}")


REQUEST_INDEX = re.compile(r"^request \d+: ")
"""The prefix the pipeline's refusals name a prompt by: its index in ``run()``'s list, which a
server request (always the one prompt, 0) does not need."""
STAGE_NAME = re.compile(r"^stage '[^']*': ")
"""The prefix a stage's :class:`ParamError` names it by: a server's client set the field on the
request, not on a stage it never sees."""


def _problem(e: ValueError) -> str:
    """``e``'s message without the pipeline's index of the prompt (:data:`REQUEST_INDEX`)."""
    return REQUEST_INDEX.sub("", str(e), count=1)


def _bad_request(
    e: ValueError,
    param: str | None = None,
    renamed: Mapping[str, str] | None = None,
    images: Sequence[str] = (),
) -> HTTPError:
    """A refusal as a 400 naming the request field it is about where that is known: a
    :class:`FieldError`'s, a stage's :class:`ParamError` (a sampling field: the request field of
    its name, or the one ``renamed`` gives it), an :class:`ImageItemError`'s image (its content
    part, of the prompt's ``images`` in order, named in the message as a :class:`FieldError`
    names its field), or ``param``."""
    message = _problem(e)
    if isinstance(e, FieldError):
        param = e.param
    elif isinstance(e, ParamError):
        param = (renamed or {}).get(e.field, e.field)
        message = STAGE_NAME.sub("", message, count=1)
    elif isinstance(e, ImageItemError):
        param = images[e.item]
        message = f"{param}: {e.problem}"
    return HTTPError(400, message, param)


def _refusal(refused: fanout.Refused, serve: convert.ServeRequest) -> HTTPError:
    """What a request answers when admission refused one of its replies: 429 for a full queue,
    else a 400 naming the field at fault: ``audio.voice`` for an unknown voice, a sampling
    field, an image's content part, or else the prompt (too long, media the model takes none
    of): one of a list of prompts by its place, in the message too. What is no refusal (a
    failure) is raised as it came."""
    e = refused.error
    if isinstance(e, QueueFullError):
        return HTTPError(429, f"the server's queue is full ({e}); retry later", retry_after=RETRY_QUEUE_S)
    if isinstance(e, UnknownSpeakerError):
        return _bad_request(e, "audio.voice")
    if isinstance(e, (ParamError, ImageItemError)):
        return _bad_request(e, renamed={"max_tokens": serve.max_tokens_field}, images=serve.image_parts)
    if not isinstance(e, ValueError):
        raise e from None
    param = serve.prompt_param(refused.index)
    return HTTPError(400, f"{param}: {_problem(e)}" if serve.listed else _problem(e), param)


@dataclasses.dataclass(frozen=True)
class _Head:
    """What every chunk of one streamed reply repeats, what the request asked, and how its
    tokens read in log-probabilities."""

    serve: convert.ServeRequest
    request_id: str
    model: str
    created: int
    tokens: logprobs.TokenReader
    transcripts: Transcripts
    audio_key: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)

    def audio_id(self, index: int) -> str:
        """Choice ``index``'s audio: ``audio-`` and the reply's :attr:`audio_key` (its own, not
        the request id, which a client may choose and reuse: a later reply would take over an
        earlier one's transcript), with the choice's index when it asked for more than one."""
        one = self.serve.replies == 1
        return f"audio-{self.audio_key}" if one else f"audio-{self.audio_key}-{index}"

    @property
    def expires_at(self) -> int:
        """Of the reply's audio: :data:`~omni_jax.serve.responses.AUDIO_EXPIRY_S` after the request."""
        return self.created + responses.AUDIO_EXPIRY_S


class _Contained:
    """An exception no handler took, answered inside the app with OpenAI's 500 JSON and logged
    once. Starlette answers such an exception in its outermost layer and then raises it on to
    the server, which logs a second traceback and closes the client's connection (a keep-alive
    client's next request then failed with a reset); here it ends at this request. An exception
    after the response started (a stream under way) is logged, and the response ends there.

    A request the shutdown's timeout (``--shutdown-timeout``) cuts before it answered gets a 503
    saying so, where the server sent a plain-text 500 and a traceback; a stream under way ends
    where it was (as the timeout means) with an ``error`` event saying so and ``[DONE]`` (a
    stage's failure mid-stream ends the same way; the stream used to stop mid-body, which clients
    read as a broken connection and uvicorn logged as an error), logged in one line. Either way
    the cancellation ends here: the request is answered, and its generation was cancelled with
    it. A stream that ends before its last byte otherwise, its client gone (which closed it and
    so aborted its request), is logged in one line, as a whole reply's client gone is."""

    def __init__(self, app: ASGIApp, on_error: Callable[[], None]) -> None:
        self.app, self.on_error = app, on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = events = answered = False

        async def sending(message: Message) -> None:
            nonlocal started, events, answered
            if message["type"] == "http.response.start":
                started = True
                events = (
                    dict(message.get("headers", ()))
                    .get(b"content-type", b"")
                    .startswith(b"text/event-stream")
                )
            await send(message)
            answered = message["type"] == "http.response.body" and not message.get("more_body", False)

        try:
            await self.app(scope, receive, sending)
        except ClientDisconnect:  # an ASGI 2.4 server's send once the client has gone
            _log_gone(scope)
        except asyncio.CancelledError:
            if answered:  # cut as the response's task group ended, after its last byte went out
                return
            when = "mid-response" if started else "before it answered"
            log.warning("%s %s: cut by the shutdown %s", scope["method"], scope["path"], when)
            if events:
                said = responses.error_json(503, "the server is shutting down: the stream was cut")
                body = responses.sse(said) + responses.sse("[DONE]")
                await send({"type": "http.response.body", "body": body, "more_body": False})
            elif not started:
                body = responses.error_json(
                    503, "the server is shutting down: the request was cut before it answered"
                )
                await JSONResponse(body, status_code=503)(scope, receive, send)
        except Exception as e:  # noqa: BLE001 - one request's fault: answered, logged, the server goes on
            log.exception("request failed")
            self.on_error()
            if not started:
                response = JSONResponse(responses.error_json(500, f"internal error: {e!r}"), status_code=500)
                await response(scope, receive, send)
        else:
            if events and not answered:  # an ASGI 2.3 server's stream, ended by the client's going
                _log_gone(scope)


def _log_gone(scope: Scope) -> None:
    """One line for a stream whose client went away mid-response: closing the stream aborted
    its request (:func:`~omni_jax.serve.reply.reply`), as a whole reply's client going away does
    (:meth:`_Server.unless_disconnected`, which logs the same line)."""
    _log_aborted(scope.get("state", {}).get(REQUEST_ID_STATE, f"{scope['method']} {scope['path']}"))


def _log_aborted(request_id: str) -> None:
    """The line a request whose client went away leaves in the log, streamed or whole."""
    log.info("%s: client disconnected; its request was aborted", request_id)


def build_app(pipe: AsyncOmniJaxPipeline, settings: ServeSettings) -> FastAPI:
    """The server's app; its lifespan warms the pipeline up (``/health`` is 503 until then) and
    closes it at shutdown. A shutdown during the warm-up (SIGTERM from ``docker stop`` or
    Kubernetes) does not wait for it: no request is being served, and the warm-up compiling on
    the engine thread (a daemon) can take minutes, so the pipeline is left to end with the
    process instead of being closed after it."""
    server = _Server(pipe, settings)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        warming = asyncio.create_task(server.warm()) if settings.warmup else None
        try:
            yield
        finally:
            if warming is not None and not warming.done():
                warming.cancel()
                log.info("stopped during the warm-up: its compilation is abandoned")
            else:
                await asyncio.to_thread(pipe.close)

    # No redirect of a path with a trailing slash: it would answer before the key check (a
    # keyless client would learn the route exists), with a Location built from the Host header.
    app = FastAPI(title="omni-jax", lifespan=lifespan, redirect_slashes=False)
    app.state.server = server
    tokens = logprobs.token_reader(pipe.pipeline.tokenizer)

    @app.exception_handler(HTTPError)
    async def refused(_: Request, e: HTTPError) -> JSONResponse:
        server.metrics.refused.labels(str(e.status)).inc()
        headers = None if e.retry_after is None else {"Retry-After": str(e.retry_after)}
        return JSONResponse(
            responses.error_json(e.status, e.message, e.param), status_code=e.status, headers=headers
        )

    @app.exception_handler(HTTPException)
    async def unrouted(request: Request, e: HTTPException) -> JSONResponse:
        """Routing's own refusals (an unknown path, a method a route does not take) in OpenAI's
        error JSON too, as every other error the server sends. Under ``/v1`` the key comes
        first, as on every ``/v1`` route: a client without it learns nothing of the routes."""
        if request.url.path.startswith("/v1"):
            try:
                server.authorize(request)
            except HTTPError as denied:
                return await refused(request, denied)
        server.metrics.refused.labels(str(e.status_code)).inc()
        return JSONResponse(
            responses.error_json(e.status_code, str(e.detail)), status_code=e.status_code, headers=e.headers
        )

    app.add_middleware(_Contained, on_error=lambda: server.metrics.refused.labels("500").inc())
    if settings.allowed_origins:  # outermost: a preflight is answered before any route or key
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.allowed_origins),
            allow_methods=["*"],
            allow_headers=["*"],
        )

    @app.api_route("/health", methods=["GET", "HEAD"])
    @app.api_route("/ping", methods=["GET", "POST"])
    async def health() -> Response:
        """200 once warm, 503 before (and why); ``/ping`` is vLLM's name for it (SageMaker's)."""
        if pipe.running and server.ready:
            return JSONResponse({"status": "ok"})
        reason = "engine stopped" if not pipe.running else (server.warmup_error or "warming up")
        return JSONResponse({"status": reason}, status_code=503)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def card() -> dict[str, Any]:
        return {
            "id": settings.model_name,
            "object": "model",
            "created": server.created,
            "owned_by": "omni-jax",
            "root": str(pipe.pipeline.model_dir),
            # vLLM's card: clients size max_tokens by the context
            **({"max_model_len": context} if (context := pipe.pipeline.max_model_len) is not None else {}),
        }

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        server.authorize(request)
        return JSONResponse({"object": "list", "data": [card()]})

    @app.get("/v1/models/{model:path}")
    async def model(request: Request, model: str) -> JSONResponse:
        """One model's card (OpenAI's ``models.retrieve``); 404 for a name not served."""
        server.authorize(request)
        if model != settings.model_name:
            raise HTTPError(404, f"the model {model!r} does not exist here", "model")
        return JSONResponse(card())

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        """vLLM's: the token ids a prompt (or chat messages, written with the chat template) is
        read as, a media item's placeholder expanded to its length as a request's would be, and
        the context they count against."""
        parsed = await server.admit(request, TokenizeRequest)
        reader = settings.media_reader()
        try:
            if parsed.messages is not None:
                messages = await asyncio.to_thread(
                    convert.chat_messages, parsed.messages, reader, server.transcripts.said
                )
                prompt = pipe.pipeline.chat_prompt(
                    messages,
                    add_generation_prompt=parsed.add_generation_prompt,
                    **convert.processor_kwargs(settings.mm_processor_kwargs, parsed.mm_processor_kwargs),
                )
            else:
                prompt = {"prompt": parsed.prompt}
            ids = await pipe.prompt_token_ids(prompt)
        except ValueError as e:
            raise _bad_request(e, images=reader.image_parts) from None
        return JSONResponse(
            {
                "count": len(ids),
                "max_model_len": pipe.pipeline.max_model_len,
                "tokens": ids,
                "token_strs": [tokens.text(i) for i in ids] if parsed.return_token_strs else None,
            }
        )

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        """vLLM's: the text of token ids."""
        parsed = await server.admit(request, DetokenizeRequest)
        tokenizer = pipe.pipeline.tokenizer
        if tokenizer is None:
            raise HTTPError(400, "this checkpoint has no tokenizer: its token ids have no text")
        vocab = len(tokenizer)
        bad = next((t for t in parsed.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise HTTPError(
                400, f"token id {bad} is outside the tokenizer's vocabulary [0, {vocab})", "tokens"
            )
        return JSONResponse({"prompt": tokenizer.decode(parsed.tokens)})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        parsed = await server.admit(request, ChatCompletionRequest)
        try:
            serve = await asyncio.to_thread(
                convert.chat_request,
                pipe.pipeline,
                parsed,
                settings.media_reader(),
                server.transcripts.said,
                settings.mm_processor_kwargs,
            )
        except ValueError as e:
            raise _bad_request(e) from None
        (request_id, engine_id), created = _request_ids(request, "chatcmpl"), int(time.time())
        head = _Head(serve, request_id, settings.model_name, created, tokens, server.transcripts)

        def choice(index: int, reply: fanout.Gathered) -> dict[str, Any]:
            audio_json, end = None, reply.end
            if serve.audio_format is not None and end.sample_rate is not None:
                # A talker that stopped at once leaves zero samples: still an audio object.
                pieces = [p.audio for p in reply.audio]
                samples = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
                data = responses.audio_data(samples, end.sample_rate, serve.audio_format)
                audio_json = responses.audio_json(head.audio_id(index), head.expires_at, reply.text, data)
                server.transcripts.keep(head.audio_id(index), reply.text, head.expires_at)
            entries = (
                None if serve.logprobs is None else logprobs.chat(reply.logprobs, serve.logprobs, tokens)
            )
            return responses.chat_choice(index, reply.text, end.finish_reason, audio_json, entries)

        def whole(choices: list[dict[str, Any]], usage: Usage) -> dict[str, Any]:
            return responses.chat_completion(request_id, settings.model_name, created, choices, usage.json())

        return await server.respond(
            request, serve, engine_id, lambda events: _chat_stream(events, head), choice, whole
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        parsed = await server.admit(request, CompletionRequest)
        try:
            serve = convert.completion_request(pipe.pipeline, parsed)
        except ValueError as e:
            raise _bad_request(e) from None
        (request_id, engine_id), created = _request_ids(request, "cmpl"), int(time.time())
        head = _Head(serve, request_id, settings.model_name, created, tokens, server.transcripts)

        def choice(index: int, reply: fanout.Gathered) -> dict[str, Any]:
            lists = (
                None
                if serve.logprobs is None
                else logprobs.CompletionLogprobs(serve.logprobs, tokens).json(reply.logprobs)
            )
            return responses.completion_choice(index, reply.text, reply.end.finish_reason, lists)

        def whole(choices: list[dict[str, Any]], usage: Usage) -> dict[str, Any]:
            return responses.completion(request_id, settings.model_name, created, choices, usage.json())

        return await server.respond(
            request, serve, engine_id, lambda events: _completion_stream(events, head), choice, whole
        )

    return app


async def _chat_stream(events: AsyncIterator[tuple[int, Piece | End]], head: _Head) -> AsyncIterator[bytes]:
    """SSE ``chat.completion.chunk``s, each of one choice (its ``index``): its role first, then
    ``delta.content`` as text comes (with its tokens' ``logprobs`` when asked: a chunk of tokens
    whose text is not out yet has empty content; a spoken reply's text chunks carry it as
    ``delta.audio.transcript`` too, as OpenAI's do), ``delta.audio.data`` as audio comes, and its
    finish reason; once every choice has ended, the usage if asked, then ``[DONE]``. Closed
    early (the client gone), it aborts the requests."""

    serve = head.serve
    spoken = serve.audio_format is not None

    def chunk(index: int, delta: dict[str, Any] | None, so_far: Usage | None = None, **kw: Any) -> bytes:
        if serve.continuous_usage and so_far is not None:
            kw["usage"] = so_far.json()
        chat_chunk = responses.chat_chunk(head.request_id, head.model, head.created, delta, index=index, **kw)
        return responses.sse(chat_chunk)

    def text(index: int, piece: str) -> dict[str, Any]:
        delta: dict[str, Any] = {"content": piece}
        if spoken and piece:
            delta["audio"] = responses.audio_json(head.audio_id(index), head.expires_at, piece)
        return delta

    said: dict[int, list[str]] = {}
    ends: dict[int, End] = {}
    try:
        async for index, event in events:
            if index not in said:
                said[index] = []
                role_usage = None if event.usage is None else Usage(event.usage.prompt_tokens, 0)
                yield chunk(index, {"role": "assistant", "content": ""}, role_usage)  # before any token
            if isinstance(event, End):
                if spoken and event.finish_reason != "error" and event.sample_rate is not None:
                    head.transcripts.keep(head.audio_id(index), "".join(said[index]), head.expires_at)
                finish = chunk(index, {}, event.usage, finish_reason=event.finish_reason)
                yield _end_events(event, finish, head, index)
                if event.finish_reason == "error":  # the others are aborted as the stream closes
                    yield responses.sse("[DONE]")
                    return
                ends[index] = event
                continue
            said[index].append(event.text)
            if event.logprobs and serve.logprobs is not None:
                entries = logprobs.chat(event.logprobs, serve.logprobs, head.tokens)
                yield chunk(index, text(index, event.text), event.usage, logprobs=entries)
            elif event.text:
                yield chunk(index, text(index, event.text), event.usage)
            if event.audio is not None and serve.audio_format is not None:
                data = responses.audio_data(event.audio, event.sample_rate, serve.audio_format)
                audio = responses.audio_json(head.audio_id(index), head.expires_at, "", data)
                yield chunk(index, {"audio": audio}, event.usage)
        if serve.include_usage:
            yield chunk(0, None, usage=fanout.total_usage(ends, serve.n).json())
        yield responses.sse("[DONE]")
    finally:
        await events.aclose()  # type: ignore[attr-defined]


async def _completion_stream(
    events: AsyncIterator[tuple[int, Piece | End]], head: _Head
) -> AsyncIterator[bytes]:
    """SSE ``text_completion`` chunks, each of one choice (its ``index``): text as it comes (with
    its tokens' ``logprobs`` when asked), its finish reason; once every choice has ended, the
    usage if asked, then ``[DONE]``."""
    serve = head.serve

    def chunk(
        index: int,
        text: str,
        so_far: Usage,
        finish_reason: str | None = None,
        lists: dict[str, Any] | None = None,
    ) -> bytes:
        usage = so_far.json() if serve.continuous_usage else None
        choice = responses.completion_choice(index, text, finish_reason, lists)
        return responses.sse(
            responses.completion(head.request_id, head.model, head.created, [choice], usage, chunk=True)
        )

    lists: dict[int, logprobs.CompletionLogprobs] = {}
    ends: dict[int, End] = {}
    try:
        async for index, event in events:
            if isinstance(event, End):
                yield _end_events(event, chunk(index, "", event.usage, event.finish_reason), head, index)
                if event.finish_reason == "error":  # the others are aborted as the stream closes
                    yield responses.sse("[DONE]")
                    return
                ends[index] = event
            elif event.logprobs and serve.logprobs is not None:
                pieces = lists.setdefault(index, logprobs.CompletionLogprobs(serve.logprobs, head.tokens))
                yield chunk(index, event.text, event.usage, lists=pieces.json(event.logprobs))
            elif event.text:
                yield chunk(index, event.text, event.usage)
        if serve.include_usage:
            usage = fanout.total_usage(ends, serve.n).json()
            yield responses.sse(responses.completion(head.request_id, head.model, head.created, [], usage))
        yield responses.sse("[DONE]")
    finally:
        await events.aclose()  # type: ignore[attr-defined]


def _end_events(end: End, finish_chunk: bytes, head: _Head, index: int) -> bytes:
    """A choice's end: the chunk with the finish reason, or an ``error`` event when a stage
    failed it (vLLM's convention: the status was sent with the first chunk)."""
    if end.finish_reason == "error":
        return responses.sse(responses.error_json(500, _failed(head.serve, index, end)))
    return finish_chunk


def _failed(serve: convert.ServeRequest, index: int, end: End) -> str:
    """What a reply a stage failed says: its choice too, when the request asked for several."""
    several = serve.replies > 1
    return f"the request failed{f' (choice {index})' if several else ''}: {end.error}"
