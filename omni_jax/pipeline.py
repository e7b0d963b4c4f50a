"""``OmniJaxPipeline``: load the stages a checkpoint needs, run prompts through them.

Everything about a prompt is checked before any work starts (:mod:`omni_jax.intake`), so a bad
prompt costs nothing and leaves the pipeline usable. The stages are then driven by the engine
core (:class:`~omni_jax.engine_core.EngineCore`), which advances every stage each iteration and
moves a request on the moment its stage finishes it, so different requests can be in different
stages at once. A stage is AR (:class:`ARStage`) or generation (built by its architecture's
:class:`~omni_jax.architectures.GenerationStage`, e.g. Qwen2.5-Omni's ``Code2WavStage``); the
core sees only the :class:`Stage` interface.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax

from omni_jax.architectures import architecture_of
from omni_jax.engine.compilation import CompileCounter, enable_persistent_cache
from omni_jax.engine_args import (
    check_attention_backend,
    check_backend_platform,
    check_sizes,
    check_stage_names,
    dtype_name,
)
from omni_jax.engine_core import EngineCore
from omni_jax.intake import Intake, Prompt, SamplingParamsList
from omni_jax.models.tokenizer import load_tokenizer, no_tokenizer
from omni_jax.outputs import OmniRequestOutput, StageWarmup, WarmupReport
from omni_jax.parallel.distributed import check_agreement, is_main_process, random_seed
from omni_jax.parallel.distributed import initialize as initialize_distributed
from omni_jax.parallel.mesh import mesh_shape
from omni_jax.parallel.placement import StagePlacement, sharded_or_none, stage_meshes
from omni_jax.preflight import (
    cache_shares,
    check_fed_lengths,
    check_memory_before_loading,
    check_stage_engines,
    stage_graph,
    stage_needs,
)
from omni_jax.progress import RequestsBar, WarmupBar
from omni_jax.safetensors_io import checkpoint_files
from omni_jax.stages.ar import ARStage
from omni_jax.stages.base import Stage
from omni_jax.stages.config import PipelineConfig
from omni_jax.weights import is_converted, load_part


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


CONTENT_TYPES = ("text", "audio", "image", "video")
"""The ``type`` of a chat message's content item :meth:`OmniJaxPipeline.chat_prompt` takes (the
chat template would drop any other silently, and its data with it)."""


class OmniJaxPipeline:
    """Multi-stage inference over one checkpoint (the public API; docs/ARCHITECTURE.md)."""

    _ids = itertools.count()

    def __init__(self, model_dir: Path, config: PipelineConfig, stages: list[Stage], tokenizer: Any):
        self.model_dir = model_dir
        self.config = config
        self.stages = stages
        self.tokenizer = tokenizer
        self.intake = Intake(stages, tokenizer, model_dir)
        self.core = EngineCore(stages, tokenizer)

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
        limit_mm_per_prompt: dict[str, int] | None = None,
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

        ``limit_mm_per_prompt``: vLLM's, e.g. ``{"image": 0, "video": 0}``: the most media items
        of each kind a prompt may hold, in place of the thinker YAML's ``engine`` entry
        (:class:`~omni_jax.stages.thinker.MediaLimits`: a kind capped at 0 is off, its encoder
        not compiled at warm-up).
        """
        path = Path(path)
        dtype = dtype_name(dtype)
        check_stage_names(stages)
        check_attention_backend(attention_backend)
        check_sizes(
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            num_pages=num_pages,
            page_size=page_size,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        initialize_distributed()
        check_backend_platform(attention_backend, jax.default_backend())
        enable_persistent_cache(compilation_cache)
        if not (path / "config.json").exists():
            missing = "no such checkpoint directory" if not path.exists() else None
            raise ValueError(f"{path}: {missing or 'not a checkpoint directory (no config.json)'}")
        from omni_jax.weights import load_hf_config

        hf_config = load_hf_config(path)
        arch = architecture_of(hf_config)
        config = stage_graph(path, arch, hf_config, stage_config, stages)
        if limit_mm_per_prompt is not None:
            config = config.with_media_limits(limit_mm_per_prompt)
        engine = (dtype, mesh, max_num_seqs, max_model_len, num_pages, page_size, max_num_batched_tokens)
        check_agreement("engine arguments or stage config", (config, engine, attention_backend))
        check_stage_engines(arch, config.stages)
        if not is_converted(path):  # no weights at all comes before a missing side file (voices)
            checkpoint_files(path)
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
        engine = dict(
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
        # Each AR stage is built with the plan just checked; its max_model_len, resolved there,
        # is what the stage admits, and what it hands on at most to the stage it feeds.
        plans = {s.name: s.plan for s in needs if s.plan is not None}
        lengths = {name: plan.geometry.max_model_len for name, plan in plans.items()}
        check_fed_lengths(config.stages, lengths)
        for sc, need in zip(config.stages, needs, strict=True):
            stage_mesh = sharded_or_none(meshes[sc.name])
            # Into the abstract model the check was made with: not traced a second time.
            model, _ = load_part(
                path, sc.name, dtype=dtype, mesh=stage_mesh, progress=progress, template=need.model
            )
            part = arch.part(sc.name)
            if sc.kind == "generation":
                built.append(
                    part.generation_stage().build(sc, model, path, stage_mesh, lengths.get(sc.input))
                )
                continue
            # The frontend sizes its encoder calls to the prompts the stage admits.
            frontend = None
            if part.frontend is not None:
                frontend = part.frontend(hf_config, model, path, sc, lengths[sc.name])
            built.append(
                ARStage.build(
                    sc,
                    model,
                    path,
                    plans[sc.name],
                    num_pages=num_pages,
                    backend=attention_backend,
                    mesh=stage_mesh,
                    frontend=frontend,
                    share=shares[sc.name],
                )
            )
        connect_stages(built)
        return cls(path, config, built, load_tokenizer(path))

    @property
    def text_stage(self) -> int | None:
        """The index of the built stage that writes the reply's text; ``None`` when none does (a
        code2wav-only pipeline)."""
        return self.core.text_stage

    @property
    def speaks(self) -> bool:
        """Whether a built stage makes audio (its replies can be spoken)."""
        return any(s.config.final_output == "audio" for s in self.stages)

    @property
    def max_model_len(self) -> int | None:
        """The context of the stage that writes the text (prompt and reply tokens together);
        ``None`` when no built stage writes text."""
        text = None if self.text_stage is None else self.stages[self.text_stage]
        return text.max_model_len if isinstance(text, ARStage) else None

    def chat_prompt(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **mm_processor_kwargs: Any,
    ) -> dict[str, Any]:
        """A prompt dict for :meth:`run` from chat messages, with the checkpoint's chat template.

        A message's ``content`` is a string or a list of items ``{"type": "text", "text": ...}``,
        ``{"type": "audio", "audio": array | path | file bytes}``, ``{"type": "image", "image": ...}``,
        ``{"type": "video", "video": frames | path | file bytes}``; the template writes each media item's
        placeholder and the item goes to ``multi_modal_data`` in the same order.
        ``mm_processor_kwargs`` (e.g. ``use_audio_in_video=True``, ``fps=2``) are passed on.
        """
        if self.tokenizer is None:
            raise ValueError(f"{no_tokenizer(self.model_dir)}, and so no chat template")
        media: dict[str, list[Any]] = {}
        for message in messages:
            content = message.get("content")
            for item in content if isinstance(content, list) else ():
                kind = item.get("type") if isinstance(item, dict) else None
                if kind not in CONTENT_TYPES:
                    raise ValueError(
                        f"a content item must be a dict whose 'type' is one of {list(CONTENT_TYPES)}, "
                        f"got {item!r:.80}"
                    )
                if kind in ("audio", "image", "video"):
                    if kind not in item:
                        raise ValueError(
                            f"a content item of type {kind!r} needs its data under the key {kind!r}"
                        )
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

    def prompt_token_ids(self, prompt: Prompt) -> list[int]:
        """The token ids the first stage reads for ``prompt``, as :meth:`run` prepares them (a
        media item's placeholder expanded to its length): what counts against
        ``max_model_len``, and vLLM's ``/tokenize``. ``ValueError`` for a prompt ``run`` refuses
        the same way."""
        return list(self.intake.prepared(0, prompt).token_ids)

    def warmup(self, progress: bool = True) -> WarmupReport:
        """Compile every program traffic can need, stage by stage, ahead of it: after this no
        request mix compiles anything (docs/ARCHITECTURE.md, "Compile once"). ``progress``: a bar over the
        stages with the XLA compilations so far."""
        stages: dict[str, StageWarmup] = {}
        # What run() and a seedless request call across processes, compiled ahead too.
        check_agreement("warm-ups", None)
        if jax.process_count() > 1:
            random_seed()
        with WarmupBar([s.config.name for s in self.stages], enabled=progress) as bar:
            for stage in self.stages:
                with CompileCounter() as counted:
                    t0 = time.perf_counter()
                    programs = stage.warmup()
                stages[stage.config.name] = StageWarmup(
                    programs, counted.compiles, counted.loads, time.perf_counter() - t0
                )
                bar.stage_done()
        return WarmupReport(stages)

    def run(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params_list: SamplingParamsList = None,
        progress: bool = True,
    ) -> list[OmniRequestOutput]:
        """Run every prompt through the stages; outputs come back in prompt order.

        With several processes every one must call this with the same prompts; only process
        0 gets the outputs (the others get an empty list).
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        check_agreement("prompts or sampling params", (prompts, sampling_params_list))
        ids = [str(next(self._ids)) for _ in prompts]
        admitted = self.intake.admit(prompts, sampling_params_list, ids)
        outputs = [self.core.add(a) for a in admitted]
        with RequestsBar(len(outputs), enabled=progress) as bar:
            while self.core.has_work():
                for update in self.core.step():
                    if update.finished:
                        bar.request_done(self.core.generated_tokens)
                bar.step_done()
        return outputs if is_main_process() else []
