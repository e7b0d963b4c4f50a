"""A checkpoint without a tokenizer's vocabulary: clear errors naming it, not an "empty prompt".

``AutoTokenizer`` builds a tokenizer from ``tokenizer_config.json`` alone whose vocabulary is
empty, so before this a text prompt became no ids and failed as "request 0: empty prompt".
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from omni_jax import OmniJaxPipeline, SamplingParams
from omni_jax.models.tokenizer import has_vocabulary, no_tokenizer

ENGINE = dict(max_num_seqs=2, max_model_len=64, page_size=16)


def without_vocabulary(src: Path, dst: Path) -> Path:
    """``src`` with ``tokenizer.json`` removed: ``tokenizer_config.json`` and the chat template stay."""
    shutil.copytree(src, dst)
    (dst / "tokenizer.json").unlink()
    assert (dst / "tokenizer_config.json").exists() and not has_vocabulary(dst)
    return dst


def test_text_prompt_without_a_tokenizer_names_it_and_the_path(qwen2_dir, tmp_path) -> None:
    path = without_vocabulary(qwen2_dir, tmp_path / "ckpt")
    pipe = OmniJaxPipeline.from_pretrained(path, **ENGINE)
    assert pipe.tokenizer is None
    greedy = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    message = (
        f"request 0: a text prompt needs a tokenizer and {path} has no tokenizer (none of tokenizer.json, "
        "vocab.json with merges.txt, tokenizer.model or *.tiktoken); give its token ids in 'prompt_token_ids'"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        pipe.run(["hello"], greedy)
    with pytest.raises(ValueError, match=re.escape(f"{no_tokenizer(path)}, and so no chat template")):
        pipe.chat_prompt([{"role": "user", "content": "hello"}])
    # stop strings are read from the reply's text: refused at admission, not failed at run time
    stopped = SamplingParams(temperature=0.0, max_tokens=2, stop=["x"])
    with pytest.raises(ValueError, match=re.escape(f"request 0: stop strings need a tokenizer, and {path}")):
        pipe.run([{"prompt_token_ids": [1, 2, 3]}], stopped)
    (out,) = pipe.run([{"prompt_token_ids": [1, 2, 3]}], greedy)  # token ids are still served
    assert len(out.token_ids) == 2 and out.text is None  # the contract: no tokenizer, no text


def test_omni_processor_without_a_tokenizer_is_refused_at_load(omni_dir, tmp_path) -> None:
    path = without_vocabulary(omni_dir, tmp_path / "ckpt")
    message = f"{no_tokenizer(path)}; its processor (preprocessor_config.json) needs one"
    with pytest.raises(ValueError, match=re.escape(message)):
        OmniJaxPipeline.from_pretrained(path, stages=["thinker"], **ENGINE)


def test_a_vocabulary_is_one_whole_file_set(tmp_path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "vocab.json").write_text("{}")
    assert not has_vocabulary(tmp_path)  # byte-level BPE needs its merges too
    (tmp_path / "merges.txt").write_text("")
    assert has_vocabulary(tmp_path)
