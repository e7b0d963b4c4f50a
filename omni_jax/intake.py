"""Turning user prompts and sampling params into validated requests, before any work.

Both :meth:`OmniJaxPipeline.run` and :meth:`AsyncOmniJaxPipeline.generate` admit requests here:
every prompt is tokenized and prepared by the first stage, and every stage checks its params and
what the prompt asks of it, so bad input raises ``ValueError`` naming the request index before
anything is queued, and leaves the stages untouched. Admission only reads the stages (host work:
tokenizing, media processing), so it may run off the thread that steps them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np

from omni_jax.engine.sampling import SamplingParams
from omni_jax.models.tokenizer import no_tokenizer
from omni_jax.stages.ar import ARStage
from omni_jax.stages.base import Stage, StageInput, StageParams, text_only, text_stage

Prompt = str | dict[str, Any]
PROMPT_KEYS = (
    "prompt",
    "prompt_token_ids",
    "multi_modal_data",
    "mm_processor_kwargs",
    "modalities",
    "speaker",
)
"""What a prompt dict may hold; any other key is refused, so that a typo (``"speakr"``) is an
error rather than a default voice."""
StageParamsEntry = StageParams | Sequence[StageParams] | None
"""What a request gives one stage in ``sampling_params_list``: one params object for every
prompt, a list or tuple of one per prompt, or ``None`` (the stage's defaults)."""
SamplingParamsList = StageParamsEntry | Sequence[StageParamsEntry]
"""What :meth:`OmniJaxPipeline.run <omni_jax.pipeline.OmniJaxPipeline.run>` and
:meth:`AsyncOmniJaxPipeline.generate <omni_jax.async_pipeline.AsyncOmniJaxPipeline.generate>`
take as ``sampling_params_list``: ``None`` (every stage's defaults); for a single stage, its
:data:`StageParamsEntry`; for several, a list or tuple of one entry per stage. The stages check
each params object's type (:func:`~omni_jax.stages.base.check_params`)."""


@dataclasses.dataclass
class Admission:
    """A request that passed every check: the first stage's input and one params object per
    stage. ``index`` is the request's place in its call (what error messages name)."""

    index: int
    request_id: str
    input: StageInput
    stage_params: list[StageParams]

    @property
    def prompt(self) -> dict[str, Any]:
        """The user's prompt dict (speaker, modalities, media)."""
        return self.input.prompt


class Intake:
    """Admits requests for a built stage graph (``stages``, first to last)."""

    def __init__(self, stages: Sequence[Stage], tokenizer: Any, model_dir: Path):
        self.stages = list(stages)
        self.tokenizer = tokenizer
        self.model_dir = model_dir

    def admit(
        self,
        prompts: Sequence[Prompt],
        sampling_params_list: SamplingParamsList,
        request_ids: Sequence[str],
        within_context: bool = False,
    ) -> list[Admission]:
        """Every prompt checked and prepared, or ``ValueError`` naming the first bad one (its
        index in ``prompts``); ``sampling_params_list`` follows the contract's conventions (one
        entry per stage, each one params object or one per prompt; ``None``: the defaults).
        ``within_context``: an AR first stage's ``max_tokens`` must fit in its context after the
        prompt (:meth:`ARStage.check_room <omni_jax.stages.ar.ARStage.check_room>`)."""
        params = self._stage_params(sampling_params_list, len(prompts))
        admitted = []
        first = self.stages[0]
        for i, (prompt, request_id) in enumerate(zip(prompts, request_ids, strict=True)):
            request = self.prepared(i, prompt)
            self._check_modalities(i, request.prompt)
            per_request = [p[i] for p in params]
            for si, stage in enumerate(self.stages):
                stage.validate(i, request if si == 0 else None, per_request[si], request.prompt)
            self._check_fed(i, request, per_request[0])
            self._check_stop(i, request.prompt, per_request)
            if within_context and isinstance(first, ARStage):
                first.check_room(i, request, per_request[0])
            admitted.append(Admission(i, request_id, request, per_request))
        return admitted

    def prepared(self, index: int, prompt: Prompt) -> StageInput:
        """``prompt`` as the first stage reads it: its token ids (each media item's placeholder
        expanded to the item's length) and what its steps need; ``ValueError`` naming
        ``index`` for a prompt it cannot read."""
        return self.stages[0].prepare(index, self._prompt_input(index, prompt))

    def _prompt_input(self, index: int, prompt: Prompt) -> StageInput:
        if isinstance(prompt, str):
            prompt = {"prompt": prompt}
        if not isinstance(prompt, dict):
            raise ValueError(f"request {index}: a prompt is a str or a dict, got {type(prompt).__name__}")
        unknown = [k for k in prompt if k not in PROMPT_KEYS]
        if unknown:
            raise ValueError(
                f"request {index}: unknown prompt key(s) {unknown}; a prompt dict takes {list(PROMPT_KEYS)}"
            )
        if "speaker" in prompt and all(s.config.final_output == "text" for s in self.stages):
            raise ValueError(
                f"request {index}: 'speaker' names a voice, and the built stages "
                f"{[s.config.name for s in self.stages]} only write text"
            )
        if "prompt_token_ids" in prompt and "prompt" in prompt:
            raise ValueError(f"request {index}: give 'prompt' or 'prompt_token_ids', not both")
        if "prompt_token_ids" in prompt:
            return StageInput(_token_ids(index, prompt["prompt_token_ids"]), prompt)
        if "prompt" in prompt:
            if not isinstance(prompt["prompt"], str):
                raise ValueError(
                    f"request {index}: 'prompt' must be a str (token ids go in 'prompt_token_ids'), "
                    f"got {type(prompt['prompt']).__name__}"
                )
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

    def _stage_params(self, sampling_params_list: SamplingParamsList, n: int) -> list[list[StageParams]]:
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

    def _check_stop(self, index: int, prompt: dict[str, Any], params: list[StageParams]) -> None:
        """Stop strings cut the text stage's reply, which the engine core reads as text: they
        need a tokenizer, and a reply no later stage speaks (the talker reads the thinker's
        states as they come: a cut reply would already be partly spoken)."""
        text = text_stage(self.stages)
        for si, (stage, p) in enumerate(zip(self.stages, params, strict=True)):
            if not (isinstance(p, SamplingParams) and p.stop_strings):
                continue
            if si != text:
                raise ValueError(
                    f"request {index}: stage {stage.config.name!r}: stop strings cut the text stage's reply "
                    "alone, and this stage writes no text"
                )
            if self.tokenizer is None:
                raise ValueError(
                    f"request {index}: stop strings need a tokenizer, and {no_tokenizer(self.model_dir)}"
                )
            if si + 1 < len(self.stages) and not text_only(prompt):
                raise ValueError(
                    f"request {index}: stop strings are served for text output only (modalities ['text'])"
                )

    def _check_fed(self, index: int, request: StageInput, params: StageParams) -> None:
        """Each AR stage an AR first stage feeds, when the request reaches it, can take the
        prompt it will build from ``request`` (:meth:`ARStage.check_fed
        <omni_jax.stages.ar.ARStage.check_fed>`), given the most tokens the first stage can
        write for it (its ``max_tokens``, and its context after the prompt)."""
        first = self.stages[0]
        if not isinstance(first, ARStage) or (
            first.config.final_output == "text" and text_only(request.prompt)
        ):
            return
        room = first.max_model_len - len(request.token_ids)
        most = cast(SamplingParams, params).max_tokens  # validate refused any other type
        reply_room = room if most is None else min(room, most)
        for stage in self.stages[1:]:
            if isinstance(stage, ARStage) and stage.config.input == first.config.name:
                stage.check_fed(index, request, reply_room)

    def _check_modalities(self, index: int, prompt: dict[str, Any]) -> None:
        """``modalities`` lists outputs the built stages can produce (``"text"``, ``"audio"``)."""
        wanted = prompt.get("modalities")
        if wanted is None:
            return
        produced = {s.config.final_output for s in self.stages}
        names = isinstance(wanted, (list, tuple)) and all(isinstance(m, str) for m in wanted)
        if not names or not wanted or not set(wanted) <= {"text", "audio"}:
            raise ValueError(
                f"request {index}: modalities must be a non-empty list of 'text'/'audio', got {wanted!r}"
            )
        missing = sorted(set(wanted) - produced)
        if missing:
            raise ValueError(
                f"request {index}: modalities {missing} not produced by the built stages "
                f"{[s.config.name for s in self.stages]}"
            )


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
