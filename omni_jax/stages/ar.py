"""An autoregressive stage: continuous batching over a paged KV cache (``AREngine``)."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any, Generic, Protocol, cast

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from omni_jax.cpu_schedule import cpu_step_bytes, gather_copies
from omni_jax.engine.ar_engine import AREngine
from omni_jax.engine.ar_runner import ARModel, ARRunner
from omni_jax.engine.buckets import max_sequence_rows, max_token_rows
from omni_jax.engine.kv_cache import CacheConfig, CacheGeometry
from omni_jax.engine.memory import (
    ARMemory,
    ProgramBytes,
    available_bytes,
    memory_pools,
    pool_key,
    refuse_unless_fits,
)
from omni_jax.engine.sampling import SUPPRESS_WIDTH, ParamError, SamplingParams
from omni_jax.engine.scheduler import ARRequest
from omni_jax.engine.step import S, StepInputs
from omni_jax.models.attention import chunk_bytes
from omni_jax.parallel.mesh import axis_size
from omni_jax.parallel.rules import ShardRule, replicated_kv_heads, shard_size
from omni_jax.stages.base import (
    HiddenHandoff,
    PromptMedia,
    Stage,
    StageInput,
    StageLoad,
    StageParams,
    StageResult,
    StageStep,
    check_ids,
    check_params,
    no_multimodal,
)
from omni_jax.stages.config import StageConfig


class ARFrontend(Protocol[S]):
    """What a model adds to the generic AR stage when token ids are not all it reads; ``S``
    is its per-request state (:attr:`StageInput.state`), which only it and its step inputs read.

    ``prepare`` turns a prompt (with its multimodal data) into the ids the model runs and the
    request's state (host side, before any work) when the stage reads the user's prompt;
    ``accept`` does it from the previous stage's result when a stage feeds it (see
    :meth:`~omni_jax.stages.base.Stage.accept`; ``connect`` hands it that stage once, and
    ``reads_hidden`` says whether it reads that stage's hidden states); ``check_prompt`` checks
    what the user's prompt says for a later stage (e.g. its speaker) before any work.
    ``step_inputs`` supplies each step's rotary positions and extra embedding inputs to the
    engine; ``warmup`` compiles the frontend's own programs (e.g. encoders) and returns how many.
    ``describe`` says what a request's prompt expanded to, for messages (``""``: nothing to
    add); ``fed_length`` how long this stage's prompt will be for a request whose feeding stage's
    prompt is ``prompt_ids`` and which that stage can write at most ``reply_room`` tokens of
    (``None`` when this stage would never take it, or reads the user's prompt), so that a
    request this stage could not take is refused before the feeding stage's work; ``media`` is the
    layout of its prompt's media, handed to a stage reading this one's hidden states.
    ``eos_token_ids``: the stage's stop tokens (``None``: the checkpoint's
    ``generation_config.json``, which describes the first stage); ``suppress_ids``: tokens
    never sampled.

    A frontend that reads hidden states can take a request while the previous stage still
    generates it (the stage is then a :class:`~omni_jax.stages.base.FedStage`): ``start`` makes
    the request from the part of the previous stage's handoff computed so far, ``None`` until
    it holds what the prompt needs; ``grow`` adds what that stage computes next (``final``: its
    result's handoff, the rows of its last step), to the state the step inputs read (their
    ``available`` says how far it reaches).
    """

    step_inputs: StepInputs[S]
    eos_token_ids: tuple[int, ...] | None
    suppress_ids: tuple[int, ...]
    reads_hidden: bool

    def prepare(self, index: int, request: StageInput[S]) -> StageInput[S]: ...

    def warmup(self) -> int: ...

    def check_prompt(self, index: int, prompt: dict[str, Any]) -> None: ...

    def connect(self, upstream: Stage) -> None: ...

    def accept(self, index: int, upstream: StageResult, prompt: dict[str, Any]) -> StageInput[S] | None: ...

    def start(self, index: int, part: HiddenHandoff, prompt: dict[str, Any]) -> StageInput[S] | None: ...

    def grow(self, state: S, part: HiddenHandoff, final: bool) -> None: ...

    def describe(self, state: S | None) -> str: ...

    def fed_length(self, prompt_ids: list[int], reply_room: int) -> int | None: ...

    def media(self, state: S | None) -> PromptMedia: ...


class ARStage(Generic[S]):
    """Token ids in, token ids out; ``engine`` schedules and runs the steps. ``S``: the
    frontend's per-request state (``None`` without a frontend).

    A stage whose frontend reads the previous stage's hidden states is a
    :class:`~omni_jax.stages.base.FedStage` unless its YAML's ``engine.early_start`` is false:
    it takes a request while that stage still generates it, submits it once the rows its
    prompt reads are there (the talker: the thinker's prompt and first reply token) and runs
    each of its tokens once the rows it reads are (:meth:`feed`)."""

    params_type = SamplingParams
    accepts_text = True
    sample_rate = None

    def __init__(
        self,
        config: StageConfig,
        engine: AREngine[S],
        vocab_size: int,
        max_model_len: int,
        defaults: SamplingParams,
        frontend: ARFrontend[S] | None = None,
    ):
        self.config = config
        self.engine = engine
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.defaults = defaults
        self.frontend = frontend
        self.reads_hidden = frontend is not None and frontend.reads_hidden
        self.outputs_hidden: bool = config.engine.get("output_hidden_states", False)
        self.capture_hidden = self.outputs_hidden  # the pipeline also sets it when the next stage reads them
        self._submitted: dict[str, _Submitted[S]] = {}
        self._fed: dict[str, _Fed[S]] = {}

    @classmethod
    def build(
        cls,
        sc: StageConfig,
        model: Any,
        path: Path,
        plan: CachePlan,
        *,
        num_pages: int | None,
        backend: str,
        mesh: Mesh | None = None,
        frontend: ARFrontend[Any] | None = None,
        share: CacheShare | None = None,
    ) -> ARStage[Any]:
        """Size the KV cache for ``model`` and wire scheduler, runner and sampling defaults.

        ``plan``: the stage's memory plan, the one the pipeline checked before loading (of the
        same model, abstract, on the same mesh, its frontend's largest encoder call included:
        :class:`~omni_jax.preflight.StageNeeds`). ``mesh``: where the model's parameters were
        placed; the cache is split over its ``model`` axis by KV heads (replicated heads when
        ``model`` exceeds them). A cache and largest step the devices cannot hold next to the
        weights are refused here, with the numbers (:meth:`CachePlan.num_pages`), before
        anything is allocated. ``share``: what a default cache leaves to the stages built after
        this one on the same memory.
        """
        check_engine_options(sc)
        num_pages = plan.num_pages(num_pages, local_devices(mesh), sc.name, share)
        runner = ARRunner(
            model,
            CacheConfig(plan.geometry, num_pages),
            max_num_seqs=plan.max_num_seqs,
            max_num_batched_tokens=plan.max_num_batched_tokens,
            backend=backend,
            chunk_bytes=plan.memory.chunk_bytes,
            mesh=mesh,
            step_inputs=None if frontend is None else frontend.step_inputs,
        )
        if frontend is not None and frontend.eos_token_ids is not None:
            eos_ids, overrides = list(frontend.eos_token_ids), {}
        else:
            eos_ids, overrides = generation_defaults(path)
        engine: AREngine[Any] = AREngine(
            runner,
            max_num_batched_tokens=plan.max_num_batched_tokens,
            eos_token_ids=eos_ids,
            name=sc.name,
        )
        defaults = sc.default_params(SamplingParams, overrides)
        return cls(sc, engine, model.vocab_size(), plan.geometry.max_model_len, defaults, frontend)

    @property
    def capture_hidden(self) -> bool:
        """Whether this stage captures hidden states: for its outputs when its YAML asks
        (:attr:`outputs_hidden`), and for the next stage, set by the pipeline at build time,
        before warm-up, when that stage reads them. Its forward then returns them (one program
        set either way), fetched for the requests that need them
        (:attr:`StageInput.capture_hidden`)."""
        return self.engine.runner.capture_hidden

    @capture_hidden.setter
    def capture_hidden(self, capture: bool) -> None:
        self.engine.runner.capture_hidden = capture

    @property
    def capture_layer(self) -> int | None:
        """Which of transformers' ``hidden_states`` the captured hidden states are (``None``:
        the final, normed ones): set by the next stage when it meets this one
        (:meth:`~omni_jax.stages.base.Stage.connect`), before warm-up (Qwen3-Omni's talker
        reads the thinker's layer ``accept_hidden_layer``)."""
        return self.engine.runner.capture_layer

    @capture_layer.setter
    def capture_layer(self, layer: int | None) -> None:
        self.engine.runner.capture_layer = layer

    def prepare(self, index: int, request: StageInput[S]) -> StageInput[S]:
        if self.frontend is None:
            return no_multimodal(self, index, request)
        return self.frontend.prepare(index, request)

    def connect(self, upstream: Stage) -> None:
        if self.frontend is not None:
            self.frontend.connect(upstream)

    def accept(self, index: int, upstream: StageResult, prompt: dict[str, Any]) -> StageInput[S] | None:
        if self.frontend is not None:
            return self.frontend.accept(index, upstream, prompt)
        return StageInput(list(upstream.token_ids), prompt, upstream=upstream)

    def embed_tokens(self, ids: list[int]) -> Any:
        """``[len(ids), D]`` input embeddings of ``ids`` (a later stage's special tokens)."""
        return self.engine.runner.embed_tokens(ids)

    def validate(
        self,
        index: int,
        request: StageInput[S] | None,
        params: StageParams,
        prompt: dict[str, Any] | None = None,
    ) -> None:
        if prompt is not None and self.frontend is not None:
            self.frontend.check_prompt(index, prompt)
        if request is not None:
            ids = request.token_ids
            check_ids(index, ids, self.vocab_size)
            if len(ids) >= self.max_model_len:
                about = "" if self.frontend is None else self.frontend.describe(request.state)
                raise ValueError(
                    f"request {index}: prompt has {len(ids)} tokens{f' ({about})' if about else ''}, "
                    f"max_model_len is {self.max_model_len} (at least one token must be generated)"
                )
        check_params(self, index, params, self.vocab_size)
        self._check_held_back(index, cast(SamplingParams, params))  # check_params refused any other type

    def check_room(self, index: int, request: StageInput[S], params: SamplingParams) -> None:
        """``ParamError`` (``max_tokens``) when the prompt and ``params.max_tokens`` together exceed
        ``max_model_len``: what vLLM's server answers with a 400 to a request's explicit
        ``max_tokens`` (``run()`` and a server request without one stop at the context's end
        instead, with ``finish_reason="length"``)."""
        n, m = len(request.token_ids), params.max_tokens
        if m is not None and n + m > self.max_model_len:
            raise ParamError(
                f"request {index}: 'max_tokens' or 'max_completion_tokens' is too large: {m}. This model's "
                f"maximum context length is {self.max_model_len} tokens and your request has {n} input "
                f"tokens ({m} > {self.max_model_len} - {n})",
                "max_tokens",
            )

    def check_fed(self, index: int, fed: StageInput[Any], reply_room: int) -> None:
        """``ValueError`` when the prompt this stage would build from ``fed`` (the feeding stage's
        prepared input, of which that stage can write at most ``reply_room`` tokens) leaves it
        no room for one token: refused at admission, not after the feeding stage's work (a stage
        of the feeding one's ``max_model_len`` is a few tokens short for a prompt near its end)."""
        n = None if self.frontend is None else self.frontend.fed_length(fed.token_ids, reply_room)
        if n is not None and n >= self.max_model_len:
            name = self.config.name
            raise ValueError(
                f"request {index}: stage {name!r}'s prompt would have {n} tokens (built from a prompt of "
                f"{len(fed.token_ids)}), its max_model_len is {self.max_model_len} (at least one token must "
                f"be generated); shorten the prompt, give {name!r} a longer max_model_len, or ask for "
                "modalities ['text']"
            )

    def _check_held_back(self, index: int, params: SamplingParams) -> None:
        """The ids a row may have suppressed at once (stop ids under ``min_tokens``, the
        stage's never-sampled ids) fit the sampler's fixed width."""
        if params.min_tokens == 0:
            return
        held = set(params.stop_token_ids or []) | set(
            () if self.frontend is None else self.frontend.suppress_ids
        )
        if not params.ignore_eos:
            held |= set(self.engine.eos_token_ids)
        if len(held) > SUPPRESS_WIDTH:
            raise ParamError(
                f"request {index}: stage {self.config.name!r}: min_tokens={params.min_tokens} holds back "
                f"{len(held)} stop ids (stop_token_ids and EOS); at most {SUPPRESS_WIDTH} can be held back",
                "min_tokens",
            )

    def submit(self, request_id: str, request: StageInput[S], params: SamplingParams) -> None:
        started = time.perf_counter()
        req = self.engine.add_request(
            request_id,
            request.token_ids,
            params,
            request.state,
            suppress_ids=() if self.frontend is None else self.frontend.suppress_ids,
            capture_hidden=request.capture_hidden,
        )
        self._submitted[request_id] = _Submitted(req, started, request.stream_hidden)

    # -- fed (FedStage) -----------------------------------------------------------------
    def streams(self, params: SamplingParams) -> bool:
        """Whether requests are taken while the previous stage generates them: when the frontend
        reads its hidden states, unless the stage YAML's ``engine.early_start`` is false."""
        return self.reads_hidden and self.config.engine.get("early_start", True)

    def open(
        self,
        request_id: str,
        prompt: dict[str, Any],
        params: SamplingParams,
        capture_hidden: bool = False,
        stream_hidden: bool = False,
    ) -> None:
        self._fed[request_id] = _Fed(prompt, params, capture_hidden, stream_hidden)

    def feed(
        self,
        index: int,
        request_id: str,
        tokens: list[int],
        upstream: StageResult | None,
        rows: HiddenHandoff | None = None,
    ) -> bool:
        """The previous stage's new rows (``rows``) or its result (``upstream``, when it
        finished): before the request is submitted they gather until the frontend can
        :meth:`~ARFrontend.start` it (or, at the end, :meth:`~ARFrontend.accept` it: False when
        there is nothing to do), after they :meth:`~ARFrontend.grow` its state. ``ValueError``
        (naming request ``index``) when they cannot make its input."""
        del tokens  # the rows' handoff holds the reply so far
        fed, frontend = self._fed[request_id], cast("ARFrontend[S]", self.frontend)
        final = upstream is not None
        if final and cast(StageResult, upstream).handoff is None:
            raise ValueError(f"request {index}: the previous stage kept no hidden states for it")
        part = cast(StageResult, upstream).handoff if final else rows
        if fed.state is None:
            if final:
                whole = cast(StageResult, upstream)
                if fed.parts:  # the result holds the rows since the parts; accept reads them all
                    fed.parts.append(cast(HiddenHandoff, part))
                    whole = dataclasses.replace(whole, handoff=fed.gathered())
                request = frontend.accept(index, whole, fed.prompt)
            elif part is None:
                return True
            else:
                fed.parts.append(part)
                if part.end <= len(part.prompt_ids):  # it speaks the reply: no start before its first row
                    return True
                request = frontend.start(index, fed.gathered(), fed.prompt)
            if request is None:
                if final:
                    del self._fed[request_id]
                return not final
            self.validate(index, request, fed.params)
            request.capture_hidden, request.stream_hidden = fed.capture_hidden, fed.stream_hidden
            self.submit(request_id, request, fed.params)
            fed.state, fed.parts = cast(S, request.state), []
        elif part is not None:
            frontend.grow(fed.state, part, final)
        if final:
            del self._fed[request_id]
        return True

    def abort(self, request_id: str) -> bool:
        """End the request in the engine, which frees its KV pages at once (or forget a fed
        request not yet submitted)."""
        fed = self._fed.pop(request_id, None) is not None
        if self._submitted.pop(request_id, None) is None:
            return fed
        return self.engine.abort(request_id)

    def has_work(self) -> bool:
        return self.engine.has_work()

    def load(self) -> StageLoad:
        scheduler = self.engine.scheduler
        return StageLoad(
            running=len(scheduler.running),
            waiting=len(scheduler.waiting),
            free_pages=scheduler.allocator.num_free,
            num_pages=scheduler.allocator.num_pages,
            capacity=scheduler.cfg.max_num_seqs,
        )

    def warmup(self) -> int:
        """Every step bucket (:meth:`AREngine.warmup`), then the frontend's own programs (the
        thinker's encoders); returns how many programs."""
        n = self.engine.warmup()
        return n + (0 if self.frontend is None else self.frontend.warmup())

    def step(self, block: bool = True) -> StageStep:
        """One engine step: the tokens each request sampled in the steps it read, and the
        requests it finished. Without ``block`` no read waits for the device
        (:meth:`AREngine.step <omni_jax.engine.ar_engine.AREngine.step>`): a step the device has
        not finished is read by a later call, and a call with nothing to do but wait is
        ``idle``."""
        stepped = self.engine.step(block)
        finished = stepped.finished
        new_tokens, new_rows, new_logprobs = {}, {}, {}
        ended = {req.request_id for req in finished}
        for req in stepped.read:  # the requests a step read: only theirs can have grown
            request_id = req.request_id
            submitted = self._submitted.get(request_id)
            if submitted is None or submitted.request is not req:  # aborted since
                continue
            drawn = req.output_ids
            if len(drawn) > submitted.reported:
                new_tokens[request_id] = self._outputs(submitted.request, submitted.reported)
                if req.params.logprobs is not None:
                    new_logprobs[request_id] = req.logprobs[submitted.reported : len(drawn)]
                submitted.reported = len(drawn)
            if submitted.stream_hidden and request_id not in ended:
                part = self._part(submitted)
                if part is not None:
                    new_rows[request_id] = part
        results = []
        for req in finished:
            now = time.perf_counter()
            self._fed.pop(req.request_id, None)  # it finished before the stage feeding it
            ending = self._submitted.pop(req.request_id)
            metrics = {
                "wall_s": now - ending.started,
                "num_prompt_tokens": len(req.prompt_ids),
                "num_output_tokens": len(req.output_ids),
                "num_preemptions": req.num_preemptions,
                "ttft_s": (req.first_token_time or now) - ending.started,
            }
            logprobs = req.logprobs if req.params.logprobs is not None else None
            result = StageResult(
                req.request_id, self._outputs(req, 0), req.finish_reason, metrics, logprobs, error=req.error
            )
            if req.capture_hidden and req.error is None:
                result.handoff = self._handoff(ending)
            results.append(result)
        return StageStep(results, new_tokens, new_rows=new_rows, new_logprobs=new_logprobs, idle=stepped.idle)

    def _handoff(self, submitted: _Submitted[S]) -> HiddenHandoff:
        """A finished request's hidden states: every row, or for a request that streamed them
        the rows since those last reported (its next stage took the others; they are released)."""
        req = submitted.request
        media = PromptMedia() if self.frontend is None else self.frontend.media(req.state)
        if not submitted.stream_hidden:
            return HiddenHandoff(list(req.prompt_ids), list(req.output_ids), *req.captured_states(), media)
        start = submitted.reported_rows
        rows = req.captured_since(start)
        if rows is None:
            hidden, embeds = req.captured[-1]
            rows = hidden[:0], embeds[:0]
        return HiddenHandoff(list(req.prompt_ids), list(req.output_ids), *rows, media, start)

    def _part(self, submitted: _Submitted[S]) -> HiddenHandoff | None:
        """The hidden states a streamed request's tokens added since they were last reported;
        the request then releases them (its next stage keeps what it takes)."""
        req = submitted.request
        rows = req.captured_since(submitted.reported_rows)
        if rows is None:
            return None
        media = PromptMedia() if self.frontend is None else self.frontend.media(req.state)
        # The prompt's ids never change: shared, not copied each step (the reply so far is).
        part = HiddenHandoff(req.prompt_ids, list(req.output_ids), *rows, media, submitted.reported_rows)
        submitted.reported_rows = part.end
        req.release_captured(part.end)
        return part

    def _outputs(self, request: ARRequest[S], start: int) -> list[int]:
        """The stage's outputs for the request's drawn tokens from ``start`` on: the tokens, or
        what the draw hook made of them (:meth:`~omni_jax.engine.step.DrawHook.outputs`)."""
        hook = self.engine.inputs.draw_hook
        drawn = request.output_ids
        return list(drawn[start:]) if hook is None else hook.outputs(request.state, drawn, start)


@dataclasses.dataclass
class _Submitted(Generic[S]):
    """A request the stage holds: the engine's record of it, when it was submitted, and how many
    of its output tokens :meth:`ARStage.step` has reported; when it streams its hidden states
    (``stream_hidden``), how many rows of them."""

    request: ARRequest[S]
    started: float
    stream_hidden: bool = False
    reported: int = 0
    reported_rows: int = 0


@dataclasses.dataclass
class _Fed(Generic[S]):
    """A request taken while the previous stage still generates it: its prompt and params, whether
    it captures and streams its hidden states once submitted (:meth:`ARStage.open`), the parts of
    that stage's handoff gathered before it could start, then its state once submitted."""

    prompt: dict[str, Any]
    params: SamplingParams
    capture_hidden: bool = False
    stream_hidden: bool = False
    parts: list[HiddenHandoff] = dataclasses.field(default_factory=list)
    state: S | None = None

    def gathered(self) -> HiddenHandoff:
        """The parts so far as one handoff of every row from the first token."""
        last = self.parts[-1]
        return HiddenHandoff(
            last.prompt_ids,
            last.reply_ids,
            np.concatenate([p.hidden_states for p in self.parts]),
            np.concatenate([p.embeds for p in self.parts]),
            last.media,
        )


STAGE_SIZES = ("max_num_seqs", "max_model_len", "max_num_batched_tokens")
"""The engine sizes an AR stage's YAML ``engine`` may set for that stage alone, positive integers
(``from_pretrained``'s argument, when given, sets them for every AR stage instead:
:func:`~omni_jax.preflight.engine_settings`)."""

AR_ENGINE_OPTIONS = ("early_start", "limit_mm_per_prompt", "output_hidden_states", *STAGE_SIZES)
"""The stage YAML's ``engine`` keys of an AR stage: ``early_start``, a bool
(:meth:`ARStage.streams`); ``limit_mm_per_prompt``, a thinker's media per prompt
(:class:`~omni_jax.stages.thinker.MediaLimits`, which checks it); ``output_hidden_states``, a bool
(:attr:`~omni_jax.stages.base.Stage.outputs_hidden`); the :data:`STAGE_SIZES`."""


def check_engine_options(sc: StageConfig) -> None:
    """``ValueError`` naming the stage for an ``engine`` key an AR stage does not read, an
    ``early_start`` or ``output_hidden_states`` that is not a bool, or a size that is not a
    positive integer."""
    sc.check_engine_keys(AR_ENGINE_OPTIONS)
    for key in STAGE_SIZES:
        sc.engine_int(key, 1)
    for key, default in (("early_start", True), ("output_hidden_states", False)):
        if not isinstance(sc.engine.get(key, default), bool):
            raise ValueError(f"stage {sc.name!r}: engine.{key}={sc.engine[key]!r} must be true or false")


def local_devices(mesh: Mesh | None) -> list[jax.Device]:
    """This process's devices of a stage (its first local device without a mesh)."""
    if mesh is None:
        return [jax.local_devices()[0]]
    return [d for d in mesh.devices.flat if d.process_index == jax.process_index()]


@dataclasses.dataclass(frozen=True)
class CacheShare:
    """What a default cache leaves to the stages built after it on the same memory
    (:func:`omni_jax.preflight.cache_shares`): ``reserved`` bytes per memory pool
    (:func:`~omni_jax.engine.memory.pool_key`), then ``fraction`` of what the rest leaves next to
    this stage's step is this cache's."""

    reserved: dict[object, int] = dataclasses.field(default_factory=dict)
    fraction: float = 1.0

    def left(self, device: jax.Device, count: int) -> int:
        """Bytes per device of ``device``'s pool (``count`` devices of this stage) not reserved."""
        return max(available_bytes(device)[0] - self.reserved.get(pool_key(device), 0), 0) // count


def resolve_max_model_len(model: ARModel, max_model_len: int | None) -> int:
    """The longest sequence a stage of ``model`` serves: ``max_model_len``, or by default the
    model's positions up to 4096; ``ValueError`` past the model's positions."""
    longest = model.max_positions()
    max_model_len = max_model_len or min(longest, 4096)
    if max_model_len > longest:
        raise ValueError(
            f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={longest}"
        )
    return max_model_len


@dataclasses.dataclass(frozen=True)
class CachePlan:
    """An AR stage's KV cache geometry and memory (:class:`ARMemory`, per device) before
    anything is allocated: from a loaded model or an abstract one (``nnx.eval_shape``), so
    start-up can refuse a cache or batch the devices cannot hold before loading weights."""

    geometry: CacheGeometry  # the whole cache (heads stored as the mesh needs them)
    max_num_seqs: int
    max_num_batched_tokens: int
    memory: ARMemory

    @classmethod
    def of(
        cls,
        model: ARModel,
        mesh: Mesh | None,
        *,
        max_num_seqs: int,
        max_model_len: int | None,
        page_size: int,
        max_num_batched_tokens: int,
        rules: tuple[ShardRule, ...] = (),
    ) -> CachePlan:
        """The plan of ``model`` on ``mesh`` (``None``: one device) with these engine sizes;
        ``rules``: how the stage's parameters are split over ``mesh`` (the part's
        ``shard_rules``), which sizes what a device's step holds of its weights on CPU."""
        layers, kv_heads, head_dim = model.kv_cache_shape()
        tp, data = axis_size(mesh, "model"), axis_size(mesh, "data")
        kv_heads = replicated_kv_heads(kv_heads, model.num_query_heads(), tp)
        max_model_len = resolve_max_model_len(model, max_model_len)
        if max_num_batched_tokens & (max_num_batched_tokens - 1) or max_num_batched_tokens < 16:
            raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens} must be a power of two >= 16")
        if max_num_seqs < 1 or page_size < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs} and page_size={page_size} must be >= 1")
        if page_size > max_model_len:  # every sequence would reserve a page it can never fill
            raise ValueError(f"page_size={page_size} exceeds max_model_len={max_model_len}")
        params = list(nnx.to_flat_state(nnx.state(model, nnx.Param)))
        dtype = jnp.dtype(params[0][1].dtype)
        geometry = CacheGeometry(layers, kv_heads, head_dim, dtype, page_size, max_model_len)
        platform = jax.default_backend() if mesh is None else mesh.devices.flat[0].platform
        max_rows = max_sequence_rows(max_num_seqs, data)
        token_rows = (
            max_token_rows(max_num_batched_tokens, max_rows, max_num_seqs * max_model_len, data) // data
        )
        memory = ARMemory(
            cache=geometry.shard(tp),
            num_heads=model.num_query_heads() // tp,
            vocab_size=model.vocab_size(),
            max_rows=max_rows // data,
            max_num_seqs=max_num_seqs,
            max_token_rows=token_rows,
            chunk_bytes=chunk_bytes(platform),
            activation_width=model.activation_width(tp),
            cpu_bytes=0
            if platform != "cpu"
            else cpu_step_bytes(
                [
                    math.prod(v.shape) if mesh is None else shard_size(p, tuple(v.shape), rules, mesh)
                    for p, v in params
                ],
                dtype.itemsize,
                layers,
                token_rows,
                model.num_query_heads() // tp * head_dim,
            ),
            gather_copies=0 if platform != "cpu" else gather_copies(layers, dtype.itemsize),
        )
        return cls(geometry, max_num_seqs, max_num_batched_tokens, memory)

    def with_encoder(self, encoder: ProgramBytes | None) -> CachePlan:
        """This plan with the frontend's largest encoder call (``ModelPart.encoder_memory``),
        which the stage's devices hold beside its steps (:meth:`ARMemory.programs`)."""
        return dataclasses.replace(self, memory=dataclasses.replace(self.memory, encoder=encoder))

    def num_pages(
        self, num_pages: int | None, devices: list[jax.Device], name: str, share: CacheShare | None = None
    ) -> int:
        """The cache's pages: ``num_pages``, or by default enough for ``max_num_seqs`` full-length
        sequences capped by what ``devices`` have left, less what ``share`` leaves to later
        stages (at least one sequence); ``ValueError`` with the numbers when the cache and the
        largest step cannot fit."""
        g = self.geometry
        per_seq = g.pages_per_seq
        if num_pages is None:
            share = share or CacheShare()
            fit = min(
                self.memory.pages_that_fit(share.left(d, count), share=share.fraction)
                for d, count in memory_pools(devices)
            )
            num_pages = max(per_seq, min(per_seq * self.max_num_seqs, fit))
        self.check_pages(num_pages, name)
        refuse_unless_fits(
            f"stage {name!r} (KV cache and largest step)",
            self.memory.demand(num_pages),
            devices,
            hint=self.hint(devices),
        )
        return num_pages

    def check_pages(self, num_pages: int, name: str) -> None:
        """``ValueError`` when ``num_pages`` cannot hold one full-length sequence (checked before
        any weight is read, and again when the cache is built)."""
        g = self.geometry
        if num_pages < g.pages_per_seq:
            raise ValueError(
                f"stage {name!r}: num_pages={num_pages} x page_size={g.page_size} cannot hold one "
                f"sequence of max_model_len={g.max_model_len} ({g.pages_per_seq} pages); raise "
                "num_pages or lower max_model_len"
            )

    def hint(self, devices: list[jax.Device]) -> str:
        fit = min(
            self.memory.pages_that_fit(available_bytes(d)[0] // c, 1.0) for d, c in memory_pools(devices)
        )
        g = self.geometry
        return (
            f"at most {max(fit, 0)} pages fit next to that step ({g.pages_per_seq} hold one sequence of "
            f"max_model_len={g.max_model_len}); lower num_pages, max_model_len, max_num_seqs or "
            "max_num_batched_tokens"
        )


def generation_defaults(path: Path) -> tuple[list[int], dict[str, Any]]:
    """EOS ids and sampling overrides from ``generation_config.json`` (as vLLM reads it)."""
    f = path / "generation_config.json"
    if not f.exists():
        return [], {}
    gen = json.loads(f.read_text())
    eos = gen.get("eos_token_id")
    eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    overrides: dict[str, Any] = {}
    for key in ("temperature", "top_p", "top_k", "repetition_penalty"):
        if key in gen:
            overrides[key] = gen[key]
    if gen.get("do_sample") is False:
        overrides["temperature"] = 0.0
    return eos_ids, overrides
