"""``OmniJaxPipeline``: load the stages a checkpoint needs, run prompts through them.

The loop advances every stage each iteration, and a request moves on the moment its
stage finishes it, so different requests can be in different stages at once. Everything
about a prompt is checked before any work starts, so a bad prompt costs nothing and leaves
the pipeline usable.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from tqdm.auto import tqdm

from omni_jax.engine.ar_engine import AREngine
from omni_jax.engine.ar_runner import ARRunner, CacheConfig
from omni_jax.engine.compilation import enable_persistent_cache
from omni_jax.engine.kv_cache import default_num_pages
from omni_jax.engine.sampling import SamplingParams
from omni_jax.engine.scheduler import ARRequest
from omni_jax.models.registry import architecture_of
from omni_jax.outputs import OmniRequestOutput, StageOutput
from omni_jax.stages.config import PipelineConfig, StageConfig, load_pipeline_config
from omni_jax.weights import load_part

Prompt = str | dict[str, Any]
_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


@dataclasses.dataclass
class _ARStage:
    config: StageConfig
    engine: AREngine
    vocab_size: int
    max_model_len: int
    defaults: SamplingParams


@dataclasses.dataclass
class _Pending:
    """A request on its way through the stage graph."""

    index: int
    output: OmniRequestOutput
    stage_params: list[SamplingParams]
    started: float = 0.0


class OmniJaxPipeline:
    """Multi-stage inference over one checkpoint; see DESIGN.md's public contract."""

    _ids = itertools.count()

    def __init__(self, model_dir: Path, config: PipelineConfig, stages: list[_ARStage], tokenizer: Any):
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

        ``compilation_cache``: a directory for JAX's persistent compilation cache (default
        ``~/.cache/omni_jax/xla`` or ``$OMNI_JAX_COMPILATION_CACHE``); ``False`` turns it off.
        """
        path = Path(path)
        enable_persistent_cache(compilation_cache)
        if not (path / "config.json").exists():
            raise ValueError(f"{path}: not a checkpoint directory (no config.json)")
        if mesh is not None and any(v != 1 for v in mesh.values()):
            raise ValueError(f"mesh={mesh}: sharded execution is not available yet; use one device")
        from omni_jax.weights import load_hf_config

        hf_config = load_hf_config(path)
        arch = architecture_of(hf_config)
        config = load_pipeline_config(stage_config or arch.stage_yaml).select(stages)
        built = []
        for sc in config.stages:
            model, _ = load_part(path, sc.name, dtype=dtype, progress=progress)
            built.append(
                _build_ar_stage(
                    sc,
                    model,
                    path,
                    max_num_seqs=max_num_seqs or 64,
                    max_model_len=max_model_len,
                    num_pages=num_pages,
                    page_size=page_size or 16,
                    max_num_batched_tokens=max_num_batched_tokens or 2048,
                    backend=attention_backend,
                )
            )
        return cls(path, config, built, _load_tokenizer(path))

    def warmup(self) -> int:
        """Compile every step shape the AR stages can produce; returns how many there were."""
        return sum(s.engine.warmup() for s in self.stages)

    # -- input handling ---------------------------------------------------------------
    def _prompt_ids(self, index: int, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            prompt = {"prompt": prompt}
        if not isinstance(prompt, dict):
            raise ValueError(f"request {index}: a prompt is a str or a dict, got {type(prompt).__name__}")
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) for t in ids):
                raise ValueError(f"request {index}: prompt_token_ids must be a list of ints")
            return list(ids)
        if "prompt" in prompt:
            if self.tokenizer is None:
                raise ValueError(f"request {index}: text prompt given but {self.model_dir} has no tokenizer")
            return list(self.tokenizer(prompt["prompt"])["input_ids"])
        raise ValueError(f"request {index}: prompt dict needs 'prompt' or 'prompt_token_ids'")

    def _stage_params(self, sampling_params_list: Any, n: int) -> list[list[SamplingParams]]:
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
            elif isinstance(entry, SamplingParams):
                out.append([entry] * n)
            elif isinstance(entry, (list, tuple)) and len(entry) == n:
                out.append(list(entry))
            else:
                raise ValueError(
                    f"stage {stage.config.name!r}: sampling params must be one SamplingParams or a list "
                    f"of {n} (one per prompt)"
                )
        return out

    def _validate(self, index: int, ids: list[int], params: list[SamplingParams]) -> None:
        first = self.stages[0]
        if not ids:
            raise ValueError(f"request {index}: empty prompt")
        bad = [t for t in ids if not 0 <= t < first.vocab_size]
        if bad:
            raise ValueError(
                f"request {index}: token id {bad[0]} outside the vocabulary [0, {first.vocab_size})"
            )
        if len(ids) >= first.max_model_len:
            raise ValueError(
                f"request {index}: prompt has {len(ids)} tokens, max_model_len is {first.max_model_len} "
                "(at least one token must be generated)"
            )
        for stage, p in zip(self.stages, params, strict=True):
            if not isinstance(p, SamplingParams):
                raise ValueError(f"request {index}: stage {stage.config.name!r} needs SamplingParams")
            try:
                p.validate(stage.vocab_size)
            except ValueError as e:
                raise ValueError(f"request {index}: stage {stage.config.name!r}: {e}") from None

    # -- running ----------------------------------------------------------------------
    def run(
        self, prompts: Prompt | Sequence[Prompt], sampling_params_list: Any = None, progress: bool = True
    ) -> list[OmniRequestOutput]:
        """Run every prompt through the stages; outputs come back in prompt order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        params = self._stage_params(sampling_params_list, len(prompts))
        pending = []
        for i, prompt in enumerate(prompts):
            ids = self._prompt_ids(i, prompt)
            per_request = [p[i] for p in params]
            self._validate(i, ids, per_request)
            out = OmniRequestOutput(request_id=str(next(self._ids)), prompt_token_ids=ids)
            pending.append(_Pending(i, out, per_request))
        self._drive(pending, progress)
        return [p.output for p in pending]

    def _drive(self, pending: list[_Pending], progress: bool) -> None:
        by_id: dict[str, _Pending] = {}
        first = self.stages[0]
        now = time.perf_counter()
        for p in pending:
            p.started = now
            first.engine.add_request(p.output.request_id, p.output.prompt_token_ids, p.stage_params[0])
            by_id[p.output.request_id] = p
        bar = tqdm(total=len(pending), desc="requests", unit="req", disable=not progress)
        tokens = 0
        t0 = time.perf_counter()
        with bar:
            while any(s.engine.has_work() for s in self.stages):
                for si, stage in enumerate(self.stages):
                    if not stage.engine.has_work():
                        continue
                    for req in stage.engine.step():
                        tokens += len(req.output_ids)
                        self._stage_done(by_id[req.request_id], si, req)
                        if si == len(self.stages) - 1:
                            bar.update(1)
                            bar.set_postfix(tok_s=f"{tokens / max(time.perf_counter() - t0, 1e-9):.1f}")

    def _stage_done(self, p: _Pending, stage_index: int, req: ARRequest) -> None:
        stage = self.stages[stage_index]
        out = p.output
        out.stage_outputs[stage.config.name] = StageOutput(
            token_ids=list(req.output_ids), finish_reason=req.finish_reason, logprobs=req.logprobs or None
        )
        now = time.perf_counter()
        out.metrics[stage.config.name] = {
            "wall_s": now - p.started,
            "num_prompt_tokens": len(req.prompt_ids),
            "num_output_tokens": len(req.output_ids),
            "num_preemptions": req.num_preemptions,
            "ttft_s": (req.first_token_time or now) - p.started,
        }
        p.started = now
        if stage.config.final_output == "text":
            out.token_ids = list(req.output_ids)
            out.finish_reason = req.finish_reason
            out.logprobs = req.logprobs if req.params.logprobs is not None else None
            if self.tokenizer is not None:
                out.text = self.tokenizer.decode(req.output_ids, skip_special_tokens=True)


def _load_tokenizer(path: Path) -> Any:
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def _generation_defaults(path: Path) -> tuple[list[int], dict[str, Any]]:
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


def _build_ar_stage(
    sc: StageConfig,
    model: Any,
    path: Path,
    *,
    max_num_seqs: int,
    max_model_len: int | None,
    num_pages: int | None,
    page_size: int,
    max_num_batched_tokens: int,
    backend: str,
) -> _ARStage:
    layers, kv_heads, head_dim = model.kv_cache_shape()
    spec_max = model.spec.max_position_embeddings
    max_model_len = max_model_len or min(spec_max, 4096)
    if max_model_len > spec_max:
        raise ValueError(
            f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={spec_max}"
        )
    if max_num_batched_tokens & (max_num_batched_tokens - 1) or max_num_batched_tokens < 16:
        raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens} must be a power of two >= 16")
    dtype = jax.tree.leaves(nnx.state(model, nnx.Param))[0].dtype
    pages_per_seq = -(-max_model_len // page_size)
    if num_pages is None:
        num_pages = default_num_pages(
            layers, kv_heads, head_dim, page_size, dtype, pages_per_seq * max_num_seqs
        )
    if num_pages < pages_per_seq:
        raise ValueError(
            f"num_pages={num_pages} x page_size={page_size} cannot hold one sequence of "
            f"max_model_len={max_model_len}"
        )
    cache = CacheConfig(layers, kv_heads, head_dim, num_pages, page_size, jnp.dtype(dtype), max_model_len)
    runner = ARRunner(model, cache, max_num_seqs=max_num_seqs, backend=backend)
    eos_ids, overrides = _generation_defaults(path)
    defaults = {**sc.default_sampling, **overrides}
    unknown = set(defaults) - _SAMPLING_FIELDS
    if unknown:
        raise ValueError(f"stage {sc.name!r}: unknown default_sampling keys {sorted(unknown)}")
    engine = AREngine(
        runner,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        eos_token_ids=eos_ids,
    )
    return _ARStage(sc, engine, model.spec.vocab_size, max_model_len, SamplingParams(**defaults))
