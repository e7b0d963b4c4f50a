"""``omni-jax serve PATH``: build the pipeline, then serve it over HTTP until interrupted.

The engine options are :meth:`OmniJaxPipeline.from_pretrained`'s; the pipeline is built (and
its memory checked) before the server listens, so a mistake there is one line and exit 2 like
any other command's. The server then listens at once and answers ``/health`` with 503 while it
warms up.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from omni_jax.serve import DEFAULT_MAX_BODY_BYTES


def _positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return n


def _media_limits(value: str) -> dict[str, int]:
    """``--limit-mm-per-prompt``'s JSON object (vLLM's form, e.g. ``{"image": 0, "video": 0}``);
    its kinds and counts are checked by ``from_pretrained``."""
    try:
        limits = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"must be a JSON object such as '{{\"image\": 0}}': {e}") from None
    if not isinstance(limits, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object such as '{{\"image\": 0}}', got {value}")
    return limits


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="an HF checkpoint dir or a checkpoints_convert dir")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--served-model-name", default=None, help="the name clients send as 'model' (default: PATH)"
    )
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    p.add_argument(
        "--max-queue",
        type=_positive,
        default=None,
        help="at most N requests wait for the first stage; more get 429 (default: no bound)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=_positive,
        default=DEFAULT_MAX_BODY_BYTES,
        help="larger request bodies get 413",
    )
    p.add_argument(
        "--allowed-local-media-path", default=None, help="a folder file:// media URLs may be read from"
    )
    p.add_argument(
        "--no-warmup",
        action="store_true",
        help="serve at once without compiling ahead (first requests of each shape compile: for development)",
    )
    p.add_argument("--stages", type=lambda s: s.split(","), default=None, help="e.g. thinker")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    p.add_argument("--mesh", default=None, help="every stage's mesh, e.g. data=2,model=4")
    p.add_argument("--max-num-seqs", type=_positive, default=None)
    p.add_argument("--max-model-len", type=_positive, default=None)
    p.add_argument("--num-pages", type=_positive, default=None)
    p.add_argument("--page-size", type=_positive, default=None)
    p.add_argument("--max-num-batched-tokens", type=_positive, default=None)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--stage-config", default=None, help="a stage YAML in place of the architecture's")
    p.add_argument(
        "--limit-mm-per-prompt",
        type=_media_limits,
        default=None,
        help='most media items of each kind a prompt may hold, e.g. \'{"image": 0, "video": 0}\' '
        "(a kind at 0 is off: its encoder is not compiled)",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from omni_jax.serve.app import ServeSettings, build_app
    except ModuleNotFoundError as e:
        raise ValueError(f"omni-jax serve needs {e.name}: pip install 'omni-jax[serve]'") from None
    from omni_jax.async_pipeline import AsyncOmniJaxPipeline
    from omni_jax.parallel.mesh import parse_mesh

    allowed = None
    if args.allowed_local_media_path is not None:
        allowed = Path(args.allowed_local_media_path).resolve()
        if not allowed.is_dir():
            raise ValueError(f"--allowed-local-media-path {args.allowed_local_media_path}: not a folder")
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    pipe = AsyncOmniJaxPipeline.from_pretrained(
        args.model,
        stages=args.stages,
        dtype=args.dtype,
        mesh=None if args.mesh is None else parse_mesh(args.mesh),
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        num_pages=args.num_pages,
        page_size=args.page_size,
        stage_config=args.stage_config,
        max_num_batched_tokens=args.max_num_batched_tokens,
        attention_backend=args.attention_backend,
        limit_mm_per_prompt=args.limit_mm_per_prompt,
        max_waiting=args.max_queue,
        progress=True,
    )
    settings = ServeSettings(
        model_name=args.served_model_name or args.model,
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
        allowed_media=allowed,
        warmup=not args.no_warmup,
    )
    uvicorn.run(build_app(pipe, settings), host=args.host, port=args.port, log_level=args.log_level)
    return 0
