"""``omni-jax serve PATH``: build the pipeline, then serve it over HTTP until interrupted.

The engine options are :meth:`OmniJaxPipeline.from_pretrained`'s. The address is taken first
(bound, not yet listening: connections are refused, not left waiting, while the pipeline
loads), so a port in use is one line and exit 2 at once rather than after minutes of loading;
then the pipeline is built (and its memory checked), so a mistake there is one line and exit 2
like any other command's. The server then listens and answers ``/health`` with 503 while it
warms up.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from omni_jax.cli_engine import EngineOptions, add_engine_arguments, positive
from omni_jax.serve import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_IMAGE_PIXELS

if TYPE_CHECKING:
    from omni_jax.serve.protocol import ProcessorKwargs


def _port(value: str) -> int:
    """An argparse type: a TCP port, 0 (any free one, which the start-up log names) to 65535;
    the OS would take a larger number modulo 65536."""
    try:
        port = int(value)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port (0 to 65535), got {value}")
    return port


def _api_key(value: str) -> str:
    """A key the server can require: an empty one (an unset shell variable) would let a request
    with ``Authorization: Bearer `` through, so the server would serve anyone."""
    if not value.strip():
        raise argparse.ArgumentTypeError("must not be empty (omit --api-key to serve without a key)")
    return value


def _processor_kwargs(value: str) -> ProcessorKwargs:
    """``--mm-processor-kwargs``' JSON object (vLLM's flag), checked as a request's field is."""
    from pydantic import ValidationError

    from omni_jax.serve.protocol import ProcessorKwargs, invalid_request_message

    try:
        return ProcessorKwargs.model_validate_json(value)
    except ValidationError as e:
        message, _ = invalid_request_message(e)
        raise argparse.ArgumentTypeError(
            f"must be a JSON object such as '{{\"use_audio_in_video\": true}}': {message}"
        ) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add ``omni-jax serve``'s flags to ``p``: the server's own and the engine's
    (:func:`~omni_jax.cli_engine.add_engine_arguments`), so serve builds the pipeline ``run``
    and ``plan`` describe with the same flags."""
    p.add_argument("model", help="an HF checkpoint dir or a checkpoints_convert dir")
    p.add_argument(
        "--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every IPv4 interface)"
    )
    p.add_argument("--port", type=_port, default=8000, help="0: any free port")
    p.add_argument(
        "--served-model-name", default=None, help="the name clients send as 'model' (default: PATH)"
    )
    p.add_argument(
        "--api-key", type=_api_key, default=None, help="require 'Authorization: Bearer KEY' on /v1 routes"
    )
    p.add_argument(
        "--max-queue",
        type=positive,
        default=None,
        help="at most N requests wait for the first stage; more get 429 (default: no bound)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=positive,
        default=DEFAULT_MAX_BODY_BYTES,
        help="larger request bodies get 413",
    )
    p.add_argument(
        "--allowed-local-media-path", default=None, help="a folder file:// media URLs may be read from"
    )
    p.add_argument(
        "--mm-processor-kwargs",
        type=_processor_kwargs,
        default=None,
        help="every chat request's, where it sets none of its own, e.g. '{\"use_audio_in_video\": true}'",
    )
    p.add_argument(
        "--max-image-pixels",
        type=positive,
        default=DEFAULT_MAX_IMAGE_PIXELS,
        help="the most pixels a request's images may decode to together (checked from their headers)",
    )
    p.add_argument(
        "--allowed-origins",
        nargs="+",
        default=(),
        metavar="ORIGIN",
        help="web origins whose pages may call the server (CORS), e.g. https://app.example.com, "
        "or '*' for any (default: none; vLLM's is '*')",
    )
    p.add_argument(
        "--no-warmup",
        action="store_true",
        help="serve at once without compiling ahead (first requests of each shape compile: for development)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=positive,
        default=None,
        help="seconds SIGTERM waits for requests in flight before cutting them (default: until they end)",
    )
    add_engine_arguments(p)
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="the server's and the engine's logging level (default: info)",
    )


QUIET_LOGGERS = ("jax", "absl")
"""Libraries whose INFO lines are their own bookkeeping, not the server's: JAX's backend probing
(e.g. "no TPU"), and Orbax's checkpoint handlers (through absl: a dozen lines for each stage of
a converted checkpoint). They log from WARNING unless ``--log-level debug``."""


def configure_logging(level: str) -> None:
    """The root logger at ``level`` (one of ``--log-level``'s), each line with its time, level and
    logger; :data:`QUIET_LOGGERS` at WARNING at the least, below ``debug``."""
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    root = logging.getLogger().level
    if root > logging.DEBUG:
        for name in QUIET_LOGGERS:
            logging.getLogger(name).setLevel(max(logging.WARNING, root))


def run(args: argparse.Namespace) -> int:
    """Serve ``args.model`` until interrupted (the order of the module docstring: bind the
    address, build the pipeline, listen); 0 once the server has stopped. A missing ``serve``
    extra, a bad ``--allowed-local-media-path`` or an address that cannot be had is a
    ``ValueError`` / ``OSError``: one line and exit 2."""
    try:
        import uvicorn

        from omni_jax.serve.app import ServeSettings, build_app
        from omni_jax.serve.listen import ListeningServer, bind
    except ModuleNotFoundError as e:
        raise ValueError(f"omni-jax serve needs {e.name}: pip install 'omni-jax[serve]'") from None
    from omni_jax.async_pipeline import AsyncOmniJaxPipeline

    with bind(args.host, args.port) as sock:  # closed however the build or the server ends
        allowed = None
        if args.allowed_local_media_path is not None:
            allowed = Path(args.allowed_local_media_path).resolve()
            if not allowed.is_dir():
                raise ValueError(f"--allowed-local-media-path {args.allowed_local_media_path}: not a folder")
        configure_logging(args.log_level)
        pipe = AsyncOmniJaxPipeline.from_pretrained(
            args.model,
            **EngineOptions.from_args(args).pipeline_kwargs(),
            max_waiting=args.max_queue,
            progress=True,
        )
        settings = ServeSettings(
            model_name=args.served_model_name or args.model,
            api_key=args.api_key,
            max_body_bytes=args.max_body_bytes,
            allowed_media=allowed,
            max_image_pixels=args.max_image_pixels,
            warmup=not args.no_warmup,
            allowed_origins=tuple(args.allowed_origins),
            mm_processor_kwargs=args.mm_processor_kwargs,
        )
        config = uvicorn.Config(
            build_app(pipe, settings),
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=args.shutdown_timeout,
        )
        ListeningServer(config).run(sockets=[sock])
    return 0
