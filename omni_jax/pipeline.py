"""``OmniJaxPipeline``: load the stages a checkpoint needs, run prompts through them.

The loop advances every stage each iteration, and a request moves on the moment its
stage finishes it, so different requests can be in different stages at once. Everything
about a prompt is checked before any work starts, so a bad prompt costs nothing and leaves
the pipeline usable. A stage is AR (:class:`ARStage`) or generation (:class:`Code2WavStage`);
the loop sees only the :class:`Stage` interface.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from omni_jax.architectures import architecture_of
from omni_jax.engine.compilation import CompileCounter, enable_persistent_cache
from omni_jax.engine_args import check_sizes, check_stage_names, dtype_name
from omni_jax.models.tokenizer import load_tokenizer, no_tokenizer
from omni_jax.outputs import OmniRequestOutput, StageOutput, StageWarmup, WarmupReport
from omni_jax.parallel.distributed import initialize as initialize_distributed
from omni_jax.parallel.distributed import is_main_process
from omni_jax.parallel.mesh import mesh_shape
from omni_jax.parallel.placement import StagePlacement, sharded_or_none, stage_meshes
from omni_jax.preflight import cache_shares, check_memory_before_loading, engine_settings, stage_needs
from omni_jax.profiling import scope
from omni_jax.progress import RequestsBar, WarmupBar
from omni_jax.stages.ar import ARStage
from omni_jax.stages.base import Stage, StageInput, StageResult
from omni_jax.stages.code2wav import Code2WavStage
from omni_jax.stages.config import PipelineConfig, load_pipeline_config
from omni_jax.weights import load_part

Prompt = str | dict[str, Any]


@dataclasses.dataclass
class _Pending:
    """A request on its way through the stage graph."""

    index: int
    output: OmniRequestOutput
    stage_params: list[Any]
    prompt: dict[str, Any]


def _token_ids(index: int, ids: Any) -> list[int]:
    """A list/tuple of ints or a 1-D integer array (numpy ints too: ids often come from
    tokenizers or arrays) as Python ints; anything else (floats, bools, nesting) is refused."""
    if isinstance(ids, np.ndarray) and ids.ndim == 1 and np.issubdtype(ids.dtype, np.integer):
        return [int(t) for t in ids]
    integral = (int, np.integer)
    if isinstance(ids, (list, tuple)) and all(
        isinstance(t, integral) and not isinstance(t, bool) for t in ids
    ):
        return [int(t) for t in ids]
    raise ValueError(f"request {index}: prompt_token_ids must be a list of ints or a 1-D integer array")


def connect_stages(stages: Sequence[Stage]) -> None:
    """Wire the stage graph at build time, before warm-up: each stage meets the one that feeds
    it (:meth:`Stage.connect`), and a stage whose successor reads hidden states
    (:attr:`Stage.reads_hidden`) captures them (:attr:`ARStage.capture_hidden`: its forward
    returns them, and the pipeline asks for them per request)."""
    for upstream, stage in zip(stages, stages[1:], strict=False):
        stage.connect(upstream)
        if stage.reads_hidden:
            if not isinstance(upstream, ARStage):
                raise ValueError(
                    f"stage {stage.config.name!r} reads hidden states, which {upstream.config.name!r} "
                    "(not an AR stage) does not produce"
                )
            upstream.capture_hidden = True


class OmniJaxPipeline:
    """Multi-stage inference over one checkpoint (the public API; docs/ARCHITECTURE.md)."""

    _ids = itertools.count()

    def __init__(self, model_dir: Path, config: PipelineConfig, stages: list[Stage], tokenizer: Any):
        self.model_dir = model_dir
        self.config = config
        self.stages = stages
        self.tokenizer = tokenizer

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        stages: list[str] | None = None,
        dtype: str | None = None,
        mesh: dict[str, int] | None = None,
        max_num_seqs: int | None = None,
        max_model_len: int | None = None,
        num_pages: int | None = None,
        page_size: int | None = None,
        *,
        stage_config: str | Path | None = None,
        max_num_batched_tokens: int | None = None,
        attention_backend: str = "auto",
        compilation_cache: str | Path | bool | None = None,
        progress: bool = False,
    ) -> OmniJaxPipeline:
        """Build the pipeline from an HF checkpoint dir or a ``checkpoints_convert`` dir.

        ``mesh``: ``{"data": D, "model": M}`` for every stage that does not set its own
        ``mesh``/``devices`` in the stage YAML; each stage gets its own mesh, and impossible
        layouts (too few devices, ``model`` not dividing the heads, overlapping device lists)
        raise ``ValueError`` before anything loads. With ``JAX_COORDINATOR_ADDRESS``,
        ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` set (or after
        :func:`omni_jax.parallel.initialize`), every process builds the same pipeline over all
        processes' devices.

        ``compilation_cache``: a directory for JAX's persistent compilation cache (default
        ``~/.cache/omni_jax/xla`` or ``$OMNI_JAX_COMPILATION_CACHE``); ``False`` turns it off.
        """
        path = Path(path)
        dtype = dtype_name(dtype)
        check_stage_names(stages)
        check_sizes(
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            num_pages=num_pages,
            page_size=page_size,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        initialize_distributed()
        enable_persistent_cache(compilation_cache)
        if not (path / "config.json").exists():
            raise ValueError(f"{path}: not a checkpoint directory (no config.json)")
        from omni_jax.weights import load_hf_config

        hf_config = load_hf_config(path)
        arch = architecture_of(hf_config)
        config = load_pipeline_config(stage_config or arch.stage_yaml).select(stages)
        missing = arch.missing_files(path, [sc.name for sc in config.stages])
        if missing is not None:
            raise ValueError(missing)
        meshes = stage_meshes(
            [StagePlacement(sc.name, sc.mesh, sc.devices) for sc in config.stages],
            mesh_shape(mesh),
            config.allow_shared_devices,
        )
        for sc in config.stages:  # refuse stages not served yet, or not splittable so, before loading
            arch.part(sc.name).shard_rules(hf_config, meshes[sc.name].shape["model"])
        engine = engine_settings(
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            page_size=page_size,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        # Weights, KV caches and largest steps against each memory pool, from config.json alone:
        # a layout that cannot fit is refused with the numbers before anything is read.
        needs = stage_needs(path, hf_config, list(config.stages), meshes, dtype=dtype, **engine)
        check_memory_before_loading(needs, num_pages)
        shares = cache_shares(needs)
        built: list[Stage] = []
        for sc in config.stages:
            stage_mesh = sharded_or_none(meshes[sc.name])
            model, _ = load_part(path, sc.name, dtype=dtype, mesh=stage_mesh, progress=progress)
            if sc.kind == "generation":
                built.append(Code2WavStage.build(sc, model, path, stage_mesh))
                continue
            part = arch.part(sc.name)
            frontend = None if part.frontend is None else part.frontend(hf_config, model, path, sc)
            built.append(
                ARStage.build(
                    sc,
                    model,
                    path,
                    num_pages=num_pages,
                    backend=attention_backend,
                    mesh=stage_mesh,
                    frontend=frontend,
                    share=shares[sc.name],
                    **engine,
                )
            )
        connect_stages(built)
        return cls(path, config, built, load_tokenizer(path))

    def chat_prompt(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **mm_processor_kwargs: Any,
    ) -> dict[str, Any]:
        """A prompt dict for :meth:`run` from chat messages, with the checkpoint's chat template.

        A message's ``content`` is a string or a list of items ``{"type": "text", "text": ...}``,
        ``{"type": "audio", "audio": array | path}``, ``{"type": "image", "image": ...}``,
        ``{"type": "video", "video": frames}``; the template writes each media item's
        placeholder and the item goes to ``multi_modal_data`` in the same order.
        ``mm_processor_kwargs`` (e.g. ``use_audio_in_video=True``, ``fps=2``) are passed on.
        """
        if self.tokenizer is None:
            raise ValueError(f"{no_tokenizer(self.model_dir)}, and so no chat template")
        media: dict[str, list[Any]] = {}
        for message in messages:
            content = message.get("content")
            for item in content if isinstance(content, list) else ():
                kind = item.get("type")
                if kind in ("audio", "image", "video"):
                    if kind not in item:
                        raise ValueError(f"a {kind!r} content item needs its data under the key {kind!r}")
                    media.setdefault(kind, []).append(item[kind])
        text = self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
        )
        prompt: dict[str, Any] = {"prompt": text}
        if media:
            prompt["multi_modal_data"] = media
        if mm_processor_kwargs:
            prompt["mm_processor_kwargs"] = dict(mm_processor_kwargs)
        return prompt

    def warmup(self, progress: bool = True) -> WarmupReport:
        """Compile every program traffic can need, stage by stage, ahead of it: after this no
        request mix compiles anything (docs/ARCHITECTURE.md, "Compile once"). ``progress``: a bar over the
        stages with the XLA compilations so far."""
        stages: dict[str, StageWarmup] = {}
        with WarmupBar([s.config.name for s in self.stages], enabled=progress) as bar:
            for stage in self.stages:
                with CompileCounter() as counted:
                    t0 = time.perf_counter()
                    programs = stage.warmup()
                stages[stage.config.name] = StageWarmup(programs, counted.compiles, time.perf_counter() - t0)
                bar.stage_done()
        return WarmupReport(stages)

    # -- input handling ---------------------------------------------------------------
    def _prompt_input(self, index: int, prompt: Prompt) -> StageInput:
        if isinstance(prompt, str):
            prompt = {"prompt": prompt}
        if not isinstance(prompt, dict):
            raise ValueError(f"request {index}: a prompt is a str or a dict, got {type(prompt).__name__}")
        if "prompt_token_ids" in prompt:
            return StageInput(_token_ids(index, prompt["prompt_token_ids"]), prompt)
        if "prompt" in prompt:
            first = self.stages[0]
            if not first.accepts_text:
                raise ValueError(
                    f"request {index}: the {first.config.name!r} stage takes token ids in "
                    "'prompt_token_ids', not text"
                )
            if self.tokenizer is None:
                raise ValueError(
                    f"request {index}: a text prompt needs a tokenizer and {no_tokenizer(self.model_dir)}; "
                    "give its token ids in 'prompt_token_ids'"
                )
            return StageInput(list(self.tokenizer(prompt["prompt"])["input_ids"]), prompt)
        raise ValueError(f"request {index}: prompt dict needs 'prompt' or 'prompt_token_ids'")

    def _stage_params(self, sampling_params_list: Any, n: int) -> list[list[Any]]:
        """Per stage, per request params, following the contract's conventions."""
        stages = self.stages
        if sampling_params_list is None:
            per_stage: list[Any] = [None] * len(stages)
        elif len(stages) == 1:
            per_stage = [sampling_params_list]
        else:
            if not isinstance(sampling_params_list, (list, tuple)) or len(sampling_params_list) != len(
                stages
            ):
                raise ValueError(
                    f"sampling_params_list needs one entry per stage {[s.config.name for s in stages]}"
                )
            per_stage = list(sampling_params_list)
        out = []
        for stage, entry in zip(stages, per_stage, strict=True):
            if entry is None:
                out.append([dataclasses.replace(stage.defaults) for _ in range(n)])
            elif isinstance(entry, stage.params_type):
                out.append([entry] * n)
            elif isinstance(entry, (list, tuple)) and len(entry) == n:
                out.append(list(entry))
            else:
                raise ValueError(
                    f"stage {stage.config.name!r}: sampling params must be one {stage.params_type.__name__} "
                    f"or a list of {n} (one per prompt)"
                )
        return out

    # -- running ----------------------------------------------------------------------
    def run(
        self, prompts: Prompt | Sequence[Prompt], sampling_params_list: Any = None, progress: bool = True
    ) -> list[OmniRequestOutput]:
        """Run every prompt through the stages; outputs come back in prompt order.

        With several processes every one must call this with the same prompts; only process
        0 gets the outputs (the others get an empty list).
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        params = self._stage_params(sampling_params_list, len(prompts))
        pending, inputs = [], []
        for i, prompt in enumerate(prompts):
            request = self.stages[0].prepare(i, self._prompt_input(i, prompt))
            self._check_modalities(i, request.prompt)
            per_request = [p[i] for p in params]
            for si, stage in enumerate(self.stages):
                stage.validate(i, request if si == 0 else None, per_request[si], request.prompt)
            out = OmniRequestOutput(request_id=str(next(self._ids)), prompt_token_ids=request.token_ids)
            pending.append(_Pending(i, out, per_request, request.prompt))
            inputs.append(request)
        self._drive(pending, inputs, progress)
        return [p.output for p in pending] if is_main_process() else []

    def _drive(self, pending: list[_Pending], inputs: list[StageInput], progress: bool) -> None:
        by_id: dict[str, _Pending] = {}
        first = self.stages[0]
        for p, request in zip(pending, inputs, strict=True):
            request.capture_hidden = self._capture_hidden(p, 0)
            first.submit(p.output.request_id, request, p.stage_params[0])
            by_id[p.output.request_id] = p
        tokens = 0
        with RequestsBar(len(pending), enabled=progress) as bar:
            while any(s.has_work() for s in self.stages):
                for si, stage in enumerate(self.stages):
                    if not stage.has_work():
                        continue
                    with scope(f"stage/{stage.config.name}"):
                        finished = stage.step()
                    bar.step_done()
                    for result in finished:
                        p = by_id[result.request_id]
                        self._stage_done(p, si, result)
                        if stage.config.kind == "ar":
                            tokens += len(result.token_ids)
                        if not self._hand_on(p, si, result):
                            bar.request_done(tokens)

    def _hand_on(self, p: _Pending, si: int, result: StageResult) -> bool:
        """Submit a request stage ``si`` finished to the next stage; False when it is done.

        The next stage's input processor may find nothing to do (the request ends with empty
        output, e.g. no audio when the talker stopped before its first code) or input it
        cannot take (the request alone ends with ``finish_reason="error"``).
        """
        if si == len(self.stages) - 1 or result.error is not None or self._done_after(p, si):
            return False
        nxt = self.stages[si + 1]
        try:
            request = nxt.accept(p.index, result, p.prompt)
            if request is not None:
                nxt.validate(p.index, request, p.stage_params[si + 1])
        except ValueError as e:
            p.output.finish_reason, p.output.error = "error", f"stage {nxt.config.name!r}: {e}"
            return False
        if request is None:
            self._end_empty(p, si + 1)
            return False
        request.capture_hidden = self._capture_hidden(p, si + 1)
        nxt.submit(result.request_id, request, p.stage_params[si + 1])
        return True

    def _capture_hidden(self, p: _Pending, si: int) -> bool:
        """Whether stage ``si`` captures the request's hidden states: the next stage reads them
        and the request goes on to it."""
        return si + 1 < len(self.stages) and self.stages[si + 1].reads_hidden and not self._done_after(p, si)

    def _end_empty(self, p: _Pending, si: int) -> None:
        """Stages ``si`` on had nothing to do: their outputs are empty (audio of zero samples)."""
        for stage in self.stages[si:]:
            p.output.stage_outputs[stage.config.name] = StageOutput(token_ids=[], finish_reason="stop")
            if stage.config.final_output == "audio":
                p.output.audio = np.zeros((0,), np.float32)
                p.output.sample_rate = stage.sample_rate

    def _check_modalities(self, index: int, prompt: dict[str, Any]) -> None:
        """``modalities`` lists outputs the built stages can produce (``"text"``, ``"audio"``)."""
        wanted = prompt.get("modalities")
        if wanted is None:
            return
        produced = {s.config.final_output for s in self.stages}
        if not isinstance(wanted, (list, tuple)) or not wanted or not set(wanted) <= {"text", "audio"}:
            raise ValueError(
                f"request {index}: modalities must be a non-empty list of 'text'/'audio', got {wanted!r}"
            )
        missing = sorted(set(wanted) - produced)
        if missing:
            raise ValueError(
                f"request {index}: modalities {missing} not produced by the built stages "
                f"{[s.config.name for s in self.stages]}"
            )

    def _done_after(self, p: _Pending, stage_index: int) -> bool:
        """``modalities=["text"]``: the request ends with the stage that produces its text."""
        wanted = p.prompt.get("modalities")
        produces_text = self.stages[stage_index].config.final_output == "text"
        return wanted is not None and "audio" not in wanted and produces_text

    def _stage_done(self, p: _Pending, stage_index: int, result: StageResult) -> None:
        stage = self.stages[stage_index]
        out = p.output
        out.stage_outputs[stage.config.name] = StageOutput(
            token_ids=list(result.token_ids),
            finish_reason=result.finish_reason,
            logprobs=result.logprobs or None,
        )
        out.metrics[stage.config.name] = result.metrics
        if result.error is not None:
            out.finish_reason, out.error = "error", f"stage {stage.config.name!r}: {result.error}"
            return
        if stage.config.final_output == "text":
            out.token_ids = list(result.token_ids)
            out.finish_reason = result.finish_reason
            out.logprobs = result.logprobs
            if self.tokenizer is not None:
                out.text = self.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        elif stage.config.final_output == "audio":
            out.audio, out.sample_rate = result.audio, result.sample_rate
            if not any(s.config.final_output == "text" for s in self.stages):
                # Without a text stage the request's tokens are the codes it was voiced from.
                out.token_ids, out.finish_reason = list(result.token_ids), result.finish_reason
