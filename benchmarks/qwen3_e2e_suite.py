"""e2e_qwen3 suite: Qwen3-Omni's thinker -> talker -> code2wav, our pipeline vs transformers
``Qwen3OmniMoeForConditionalGeneration.generate(return_audio=True)`` at its best.

:mod:`benchmarks.e2e_suite` run on Qwen3-Omni (:class:`Qwen3Omni` is what differs): the same mixed
workload (text, text + image, text + audio; voices alternating over the checkpoint's speakers,
``talker_config.speaker_id``), every request asking for text and speech, the same measured rounds,
figures and compile accounting, transformers in the same three configurations (request by request,
left-padded batches of 4 of one voice, all of a voice). Both sides greedy: the thinker as in the
e2e suite (2 to ``--max-tokens`` new tokens, stopping on ``<|im_end|>``), the talker with
repetition penalty 1.05 (``generate``'s default) and its code predictor greedy too (``generate``
mirrors the talker's ``do_sample`` onto it), ``--talker-max-tokens`` codec frames at most (a frame
is 12.5 a second in the released model: ``num_code_groups`` codes, the talker's first and the code
predictor's others). ``generate`` calls ``code2wav.chunked_decode(codes, 300, 25)``, one chunk
for replies of up to 300 frames; our code2wav decodes a reply whole up to its ``max_frames`` and
a longer one in the same pieces.
``--num-steps`` and ``--guidance-scale`` do not apply (a ConvNet, no flow-matching solve).

Talker tokens, as compared: each frame's codes, frame-major, then codec EOS when the talker stopped
on it. ``generate`` predicts a frame only when it feeds its first code back, so it gets
``--talker-max-tokens`` + 1 talker tokens to make as many frames as ours at most; a reply cut
there ends without EOS on both sides. Figures' ``codec_tokens`` count these tokens (all codebooks
and the stop code).

Agreement: our thinker tokens against every configuration's, our talker tokens (every codebook of
every frame) against request by request, up to checked near-ties (:mod:`benchmarks.agreement`; at
a first difference in a frame's first code the scores are the talker's, in another codebook the
code predictor's call for that frame). A disagreement fails the suite. The batched configurations'
talker tokens are compared and reported but not held to ours, because transformers 5.24's batched
``generate`` changes the talker's work for rows that are not the batch's longest: (1) a row whose
talker prompt is left-padded by ``p`` (its user turn shorter than another row's) has its first
``p`` generated codes left out of the repetition penalty (``RepetitionPenaltyLogitsProcessor``'s
``prompt_ignore_length`` is the attention mask's pad count, but the talker generates from
embeddings, so its ``input_ids`` hold generated codes only); (2) a row whose reply ended before the
longest reads its ``<|im_end|>`` embedding as one more text row before the text-end marker, so it
speaks one more frame than alone. Their timings are what a user of batched ``generate`` gets, so
they still count for the ratio.

``--suite e2e_qwen3 --stream`` is the time-to-first-audio suite (:mod:`benchmarks.qwen3_stream_suite`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import e2e_suite
from benchmarks.e2e_suite import (
    DEFAULT_NUM_REQUESTS,
    REPETITION_PENALTY,
    Family,
    Reference,
    Row,
    Scores,
    SideRun,
    StageClock,
    Workload,
    encoder_clock,
    table,
    wrapped,
)
from benchmarks.qwen3_code2wav_suite import CHUNK_FRAMES
from omni_jax import OmniJaxPipeline
from omni_jax.testing import reference_omni_processor

__all__ = ["DEFAULT_NUM_REQUESTS", "Qwen3Omni", "Qwen3Reference", "run", "table"]


class Qwen3Reference(Reference):
    """``Qwen3OmniMoeForConditionalGeneration.generate(return_audio=True)`` on left-padded
    batches of one voice (a single request is a batch of one, unpadded)."""

    engine = "transformers Qwen3OmniMoeForConditionalGeneration.generate(return_audio=True)"

    def __init__(self, path: Path, dtype: str | None, eos: int, pad: int):
        import torch
        from transformers import Qwen3OmniMoeForConditionalGeneration, Qwen3OmniMoeProcessor

        from omni_jax.testing_qwen3_omni import give_talker_audio_config

        m = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
            str(path), dtype=getattr(torch, dtype or "float32")
        ).eval()
        give_talker_audio_config(m)  # transformers 5.24's talker cannot place audio tokens otherwise
        clock = StageClock(
            {
                "thinker": (m.thinker, "generate"),
                "talker": (m.talker, "generate"),
                "code2wav": (m.code2wav, "chunked_decode"),
            }
        )
        encoders = encoder_clock(m.thinker, ("Qwen3OmniMoeAudioEncoder", "Qwen3OmniMoeVisionEncoder"))
        proc = reference_omni_processor(path, processor_class=Qwen3OmniMoeProcessor)
        super().__init__(m, proc, clock, encoders)
        self.eos, self.pad = eos, pad
        self.groups = m.config.talker_config.num_code_groups
        self.codec_eos = m.config.talker_config.codec_eos_token_id

    def batch(
        self, work: Workload, indices: list[int], ours: SideRun | None, scores: Scores
    ) -> tuple[list[Row], float]:
        m = self.model
        found: dict[str, Any] = {"predictor": []}  # each stage's generate output, the frames' codes
        inputs, preprocess_s = self._prepared(work, indices)
        width = inputs["input_ids"].shape[1]

        def recorded(key: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
            """A ``generate`` that keeps its output under ``found[key]`` (appended for the code
            predictor, called once a frame), asking for its processed scores when ``ours`` is
            given. Each returns a dict already (``generate`` asks: it reads hidden states)."""

            def wrap(generate: Callable[..., Any]) -> Callable[..., Any]:
                def call(*args: Any, **kwargs: Any) -> Any:
                    if ours is not None:
                        kwargs["output_scores"] = True
                    out = generate(*args, **kwargs)
                    if key == "predictor":
                        found[key].append(out.scores)
                    else:
                        found[key] = out
                    return out

                return call

            return wrap

        def decode(chunked: Callable[..., Any]) -> Callable[..., Any]:
            def call(codes: Any, *args: Any, **kwargs: Any) -> Any:
                found["codes"] = codes  # [batch, groups, frames]: rows past their EOS zeroed
                return chunked(codes, *args, **kwargs)

            return call

        patches = [
            (m.thinker, "generate", recorded("thinker")),
            (m.talker, "generate", recorded("talker")),
            (m.talker.code_predictor, "generate", recorded("predictor")),
            (m.code2wav, "chunked_decode", decode),
        ]
        with wrapped(patches), self.torch.no_grad():
            seq, waves = m.generate(
                **inputs,
                speaker=work.prompts[indices[0]]["speaker"],
                return_audio=True,
                thinker_max_new_tokens=work.thinker_max_tokens,
                thinker_min_new_tokens=work.thinker_min_tokens,
                thinker_do_sample=False,
                thinker_eos_token_id=self.eos,
                thinker_pad_token_id=self.pad,
                # one more token: generate drops the frame of a last token it never feeds back;
                # its minimum holds back the stop code from the first m + 1 tokens, m frames
                talker_max_new_tokens=work.talker_max_tokens + 1,
                talker_min_new_tokens=work.talker_min_tokens,
                talker_do_sample=False,
                talker_repetition_penalty=REPETITION_PENALTY,
            )
        waves = [waves] if len(indices) == 1 else waves  # one request: a tensor, else a list
        drawn = found["talker"].sequences.tolist()
        rows = []
        for r, i in enumerate(indices):
            new = seq[r, width:].tolist()
            tokens = new[: new.index(self.eos) + 1] if self.eos in new else new
            stops = self.codec_eos in drawn[r]
            frames = drawn[r].index(self.codec_eos) if stops else len(drawn[r]) - 1
            codes = found["codes"][r, :, :frames].T.reshape(-1).tolist()
            talker = codes + [self.codec_eos] if stops and frames < work.talker_max_tokens else codes
            rows.append(Row(tokens, talker, codes, int(waves[r].numel())))
            self._note_differences(
                ours, i, rows[-1], scores, lambda stage, k, r=r: self._scores(found, stage, r, k)
            )
        return rows, preprocess_s

    def _scores(self, found: dict[str, Any], stage: str, row: int, k: int) -> Any:
        """The processed scores ``generate`` chose ``row``'s token ``k`` of ``stage`` from: the
        thinker's; for the talker, frame ``k // groups``'s first code from the talker's step, its
        other codes from the code predictor's call that filled the frame."""
        if stage == "thinker":
            return found["thinker"].scores[k][row]
        frame, group = divmod(k, self.groups)
        if group == 0:
            return found["talker"].scores[frame][row]
        return found["predictor"][frame][group - 1][row]


class Qwen3Omni(Family):
    """Qwen3-Omni in the e2e suite (module docstring)."""

    suite = "e2e_qwen3"
    stage_yaml = "qwen3_omni"
    talker_unit = "frames"
    batched_talker_held = False
    code2wav_chunk = CHUNK_FRAMES

    def __init__(self, path: Path):
        from omni_jax.weights import load_hf_config

        super().__init__(path)
        self.codec_eos = load_hf_config(path).talker_config.codec_eos_token_id

    def speakers(self, pipe: OmniJaxPipeline) -> list[str]:
        return sorted(pipe.stages[1].frontend.speakers)

    def talker_tokens(self, out: Any) -> list[int]:
        talker = out.stage_outputs["talker"]
        codes = list(talker.token_ids)  # the frames, EOS's left out
        return codes + [self.codec_eos] if talker.finish_reason == "stop" else codes

    def token2wav_settings(self, work: Workload) -> str:
        return "each reply offline in generate's pieces, chunked_decode(codes, 300, 25), on both sides"

    def reference(self, dtype: str | None, pipe: OmniJaxPipeline) -> Reference:
        eos = pipe.tokenizer.convert_tokens_to_ids("<|im_end|>")
        return Qwen3Reference(self.path, dtype, eos, pipe.tokenizer.pad_token_id)


def run(path: Path, args: Any) -> dict[str, Any]:
    return e2e_suite.run(path, args, Qwen3Omni(path))
