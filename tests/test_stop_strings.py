"""Stop strings (vLLM's ``SamplingParams.stop``): the text stage's reply is cut at the first one.

``StopText`` alone first: any split of a text into deltas sends the text up to the first complete
stop string, holding back a tail that could still become one. Then the engine: ``run()`` and
``generate()`` end a request at the stop string (``finish_reason="stop"``, its KV pages freed at
once), the text cut there (or through it with ``include_stop_str_in_output``), the tokens those
generated up to it; the streamed deltas add up to the cut text. As in vLLM, a stop string counts
only where it ends in the text of tokens past ``min_tokens``, and the text of a stop token (a stop
id, or an EOS that is an ordinary token) is left out of the text unless
``include_stop_str_in_output`` asks for it, its id kept in ``token_ids``. What cannot be served is
refused before any work: stop strings on a stage that writes no text, or on a reply a later stage
speaks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_jax import (
    AsyncOmniJaxPipeline,
    OmniJaxPipeline,
    OmniRequestOutput,
    ParamError,
    SamplingParams,
    Token2WavParams,
)
from omni_jax.stop_text import StopText

# -- StopText alone ------------------------------------------------------------------------------


def stream(stops: list[str], deltas: list[str], unchecked: int = 0) -> tuple[str, bool]:
    """What is sent for ``deltas``, the first ``unchecked`` of them fed with ``check=False`` (as
    the engine core drives ``StopText``: ``flush`` after the last delta unless a stop string
    ended the text)."""
    stop = StopText(stops)
    sent = "".join(stop.feed(d, check=i >= unchecked) for i, d in enumerate(deltas))
    if not stop.hit:
        sent += stop.flush()
    return sent, stop.hit


def test_a_stop_string_split_across_deltas_is_cut_with_the_text_before_it_kept() -> None:
    stop = StopText(["STOP"])
    assert stop.feed("hello wo") == "hello"  # the last len("STOP") - 1 characters wait
    assert stop.feed("rld ST") == " world"  # " ST" could be the start of "STOP"
    assert not stop.hit
    assert stop.feed("OP and more") == " "
    assert stop.hit
    assert stop.feed("after the stop") == "" and stop.flush() == ""


def test_a_stop_string_arriving_one_character_at_a_time() -> None:
    assert stream(["</s>"], list("abc</s>def")) == ("abc", True)
    assert stream(["</s>"], list("abc</sdef")) == ("abc</sdef", False)


def test_the_earliest_stop_string_wins_whatever_its_place_in_the_list() -> None:
    assert stream(["zz", "b"], ["a", "bz", "z"]) == ("a", True)
    assert stream(["b", "zz"], ["azz", "b"]) == ("a", True)
    # a longer stop string starting earlier beats a shorter one completed first
    assert stream(["abcd", "c"], ["xab", "cd"]) == ("x", True)
    # ... but a stop string completed in an earlier delta ends the text there (the reply stops)
    assert stream(["bc", "abcd"], ["xab", "c", "d"]) == ("xa", True)


def test_the_held_tail_is_flushed_when_no_stop_string_comes() -> None:
    stop = StopText(["xyz"])
    assert stop.feed("abcxy") == "abc"
    assert stop.flush() == "xy" and not stop.hit
    assert stop.flush() == ""


def test_no_stop_strings_pass_everything_at_once() -> None:
    stop = StopText([])
    assert [stop.feed(d) for d in ["a", "bc", ""]] == ["a", "bc", ""]
    assert stop.flush() == "" and not stop.hit


def first_stop(stops: list[str], deltas: list[str], unchecked: int = 0) -> tuple[str, bool]:
    """The reference: the text so far is searched whole after each delta past the first
    ``unchecked``, and cut at the earliest start of the stop strings in it that end past those
    deltas' text, as soon as one is complete."""
    text, boundary = "", len("".join(deltas[:unchecked]))
    for i, delta in enumerate(deltas):
        text += delta
        if i < unchecked:
            continue
        found = [
            at for s in stops for at in range(len(text)) if text.startswith(s, at) and at + len(s) > boundary
        ]
        if found:
            return text[: min(found)], True
    return text, False


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(alphabet="abc", max_size=30),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=8),
    unchecked=st.integers(0, 4),
)
def test_any_split_sends_the_text_up_to_the_first_complete_stop_string(
    text: str, stops: list[str], cuts: list[int], unchecked: int
) -> None:
    """Whatever the split, and however many of the first deltas are fed unchecked (the text of
    tokens under ``min_tokens``): no stop string ending in those counts, one starting in them
    does."""
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    assert stream(stops, deltas, unchecked) == first_stop(stops, deltas, unchecked)


def test_unchecked_text_is_sent_but_no_stop_string_ends_in_it() -> None:
    stop = StopText(["ad", "abc"])
    assert stop.feed("xadab", check=False) == "xad"  # "ad" is whole, but under min_tokens
    assert not stop.hit
    assert stop.feed("cad") == ""  # "abc" started in the unchecked text: it cuts there
    assert stop.hit and stop.kept == "xad"


def test_include_keeps_the_stop_string_and_kept_is_what_was_sent() -> None:
    stop = StopText(["STOP", "ST"], include=True)
    assert stop.feed("a S") == "" and stop.feed("TOP b") == "a ST"  # the earliest, then the shortest
    assert stop.hit and stop.kept == "a ST" and stop.feed("more") == ""
    plain = StopText(["xyz"])
    assert plain.feed("abcxy") + plain.flush() == plain.kept == "abcxy"


def first_stop_included(stops: list[str], deltas: list[str], unchecked: int = 0) -> tuple[str, bool]:
    """``first_stop`` through the stop string: of those starting earliest, the shortest."""
    text, hit = first_stop(stops, deltas, unchecked)
    if not hit:
        return text, False
    whole, boundary = "".join(deltas), len("".join(deltas[:unchecked]))
    at = len(text)
    ending = [s for s in stops if whole.startswith(s, at) and at + len(s) > boundary]
    # the delta the stop string was found in: the first after which one ending past it is whole
    ends = [len("".join(deltas[: i + 1])) for i in range(len(deltas))]
    done = next(e for e in ends[unchecked:] if any(at + len(s) <= e for s in ending))
    return whole[: at + min(len(s) for s in ending if at + len(s) <= done)], True


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab", max_size=30),
    stops=st.lists(st.text(alphabet="ab", min_size=1, max_size=6), max_size=30),
    cuts=st.lists(st.integers(0, 30), max_size=8),
    unchecked=st.integers(0, 4),
)
def test_many_stop_strings_of_many_lengths_cut_at_the_earliest_then_shortest(
    text: str, stops: list[str], cuts: list[int], unchecked: int
) -> None:
    """Many stop strings sharing their characters, of many lengths (so several end at once, and
    several start where the earliest does): cut before the earliest, or through the shortest of
    those starting there with ``include``."""
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    assert stream(stops, deltas, unchecked) == first_stop(stops, deltas, unchecked)
    stop = StopText(stops, include=True)
    sent = "".join(stop.feed(d, check=i >= unchecked) for i, d in enumerate(deltas))
    if not stop.hit:
        sent += stop.flush()
    assert (sent, stop.hit) == first_stop_included(stops, deltas, unchecked)


def test_twenty_thousand_stop_strings_cut_where_one_of_them_does() -> None:
    """The lookup by last character and length with groups large enough to be sets: the one
    stop string that occurs among 20,000 of one length cuts the reply, and text in which none
    ends passes whole."""
    stops = [f"stop string number {i:06d}" for i in range(20_000)]
    deltas = [" word" for _ in range(30)]
    stop = StopText(stops)
    assert "".join(stop.feed(d) for d in deltas) + stop.flush() == "".join(deltas) and not stop.hit
    stop = StopText(stops)
    sent = "".join(stop.feed(d) for d in ["say stop string ", "number 01", "2345 and more"])
    assert (sent, stop.hit) == ("say ", True)


def test_an_empty_stop_string_is_refused() -> None:
    with pytest.raises(ValueError, match="stop strings must not be empty"):
        StopText(["x", ""])


# -- the engine ----------------------------------------------------------------------------------

PROMPT = {"prompt_token_ids": [5, 17, 42, 9, 33, 8, 71]}
SIZES = dict(max_num_seqs=2, page_size=8, max_model_len=128)


def greedy(**kw: object) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 24, "ignore_eos": True, **kw})


@pytest.fixture(scope="module")
def pipe(qwen2_dir) -> OmniJaxPipeline:
    return OmniJaxPipeline.from_pretrained(qwen2_dir, **SIZES)


@pytest.fixture(scope="module")
def engine(qwen2_dir):
    with_engine = AsyncOmniJaxPipeline.from_pretrained(qwen2_dir, **SIZES)
    yield with_engine
    with_engine.close()


def streamed(engine: AsyncOmniJaxPipeline, params: list[SamplingParams]) -> list[OmniRequestOutput]:
    """``PROMPT`` streamed by ``generate()`` once for each of ``params``, all at once; each
    request's last update, once its deltas are checked to add up to it."""

    async def collect(p: SamplingParams) -> list[OmniRequestOutput]:
        return [u async for u in engine.generate(PROMPT, p)]

    async def together() -> list[list[OmniRequestOutput]]:
        return await asyncio.wait_for(asyncio.gather(*(collect(p) for p in params)), 300)

    lasts = []
    for *before, last in asyncio.run(together()):
        assert last.finished and not any(u.finished for u in before)
        assert "".join(u.text_delta for u in [*before, last]) == last.text
        assert [t for u in [*before, last] for t in u.token_ids_delta] == last.token_ids
        lasts.append(last)
    return lasts


@pytest.fixture(scope="module")
def whole(pipe):
    (out,) = pipe.run(PROMPT, greedy(), progress=False)
    assert out.finish_reason == "length" and len(out.text) > 12
    return out


def stop_in(text: str) -> tuple[str, int]:
    """A stop string from the middle of ``text`` and where it first starts."""
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    return stop, text.find(stop)


@pytest.mark.parametrize("include", [False, True])
def test_run_cuts_the_reply_at_the_stop_string(pipe, whole, include) -> None:
    stop, at = stop_in(whole.text)
    (out,) = pipe.run(PROMPT, greedy(stop=[stop], include_stop_str_in_output=include), progress=False)
    assert out.text == whole.text[: at + len(stop) if include else at]
    assert out.finish_reason == "stop" and out.stage_outputs["llm"].finish_reason == "stop"
    n = len(out.token_ids)
    assert 0 < n < len(whole.token_ids) and out.token_ids == whole.token_ids[:n]
    # the tokens are those generated up to the stop string: one fewer would not hold it whole
    shorter = pipe.tokenizer.decode(out.token_ids[:-1], skip_special_tokens=True)
    assert stop not in shorter and stop in pipe.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert not pipe.stages[0].has_work() and pipe.stages[0].engine.scheduler.allocator.num_free == (
        pipe.stages[0].engine.scheduler.allocator.num_pages
    )


def test_a_stop_string_that_never_comes_changes_nothing(pipe, whole) -> None:
    (out,) = pipe.run(PROMPT, greedy(stop="never in this reply \u2603"), progress=False)
    assert (out.text, out.token_ids, out.finish_reason) == (whole.text, whole.token_ids, "length")


def test_stop_strings_are_per_request_in_a_batch(pipe, whole) -> None:
    stop, at = stop_in(whole.text)
    cut, full = pipe.run([PROMPT, PROMPT], [greedy(stop=stop), greedy()], progress=False)
    assert cut.text == whole.text[:at] and (full.text, full.finish_reason) == (whole.text, "length")


def test_generate_streams_the_cut_text(engine, whole) -> None:
    stop, at = stop_in(whole.text)
    (last,) = streamed(engine, [greedy(stop=[stop])])
    assert last.finish_reason == "stop" and last.text == whole.text[:at]


def prefixes(pipe, whole) -> list[str]:
    """The text of the first ``n`` tokens of ``whole``'s reply, for each ``n``."""
    ids = whole.token_ids
    texts = [pipe.tokenizer.decode(ids[:n], skip_special_tokens=True) for n in range(len(ids) + 1)]
    assert all(whole.text.startswith(t) for t in texts)  # each token adds text; none rewrites it
    return texts


def held_back(pipe, whole, stop: str, min_tokens: int) -> tuple[str, list[int], str]:
    """The reference for a stop string under ``min_tokens`` (vLLM's detokenizer): ``(text,
    token_ids, finish_reason)`` of ``whole`` cut at the first ``stop`` that ends past the text
    of its first ``min_tokens`` tokens (it may start in it), the tokens those up to the one it
    ends in."""
    ids, texts = whole.token_ids, prefixes(pipe, whole)
    boundary = len(texts[min_tokens])
    at = whole.text.find(stop, max(0, boundary - len(stop) + 1))
    if at < 0:
        return whole.text, ids, "length"
    n = next(n for n, t in enumerate(texts) if len(t) >= at + len(stop))
    return whole.text[:at], ids[:n], "stop"


def repeated(text: str) -> str:
    """The first three characters of ``text`` that come again later in it."""
    return next(text[i : i + 3] for i in range(len(text)) if text.find(text[i : i + 3], i + 1) > i)


def test_min_tokens_holds_back_stop_strings_ending_in_its_tokens(pipe, whole) -> None:
    """For every ``min_tokens`` (every token boundary), with a stop string in the middle of the
    reply and one that comes twice: one ending in the text of the first ``min_tokens`` tokens is
    passed over (the reply goes on to a later one, or to ``max_tokens``: ``length``), one that
    starts there and ends after is found."""
    stops = (stop_in(whole.text)[0], repeated(whole.text))
    cases = [(stop, m) for stop in stops for m in range(len(whole.token_ids) + 1)]
    outs = pipe.run([PROMPT] * len(cases), [greedy(stop=s, min_tokens=m) for s, m in cases], progress=False)
    got = dict(zip(cases, [(out.text, out.token_ids, out.finish_reason) for out in outs], strict=True))
    assert got == {(stop, m): held_back(pipe, whole, stop, m) for stop, m in cases}
    # every kind of case came up: a stop string starting in the held-back text, one passed over
    # for a later one, and none left
    texts = prefixes(pipe, whole)
    assert any(r == "stop" and len(texts[m]) > len(text) for (_, m), (text, _, r) in got.items())
    assert any(r == "stop" and (text, ids, r) != got[stop, 0] for (stop, _), (text, ids, r) in got.items())
    assert any(r == "length" for _, _, r in got.values())


def test_generate_holds_back_stop_strings_under_min_tokens(engine, pipe, whole) -> None:
    stop = repeated(whole.text)
    first = held_back(pipe, whole, stop, 0)
    min_tokens = len(first[1])  # the first one ends in the last token held back: the second cuts
    cut, length = streamed(
        engine, [greedy(stop=stop, min_tokens=min_tokens), greedy(stop=stop, min_tokens=24)]
    )
    assert (cut.text, cut.token_ids, cut.finish_reason) == held_back(pipe, whole, stop, min_tokens) != first
    assert (length.text, length.token_ids, length.finish_reason) == (whole.text, whole.token_ids, "length")


def stop_token(pipe, whole) -> tuple[int, int]:
    """A token of the second half of the reply with text of its own, whole characters (not a
    special token, nor part of a character, whose text a stream holds back anyway), and where it
    first comes."""
    texts = {t: pipe.tokenizer.decode([t], skip_special_tokens=True) for t in whole.token_ids}
    half = whole.token_ids[len(whole.token_ids) // 2 :]
    token = next(t for t in half if texts[t] and "\ufffd" not in texts[t])
    return token, whole.token_ids.index(token)


def without_stop_token(pipe, whole, n: int, include: bool) -> str:
    """The text of a reply cut after its ``n`` th token, that token's left out unless ``include``."""
    return pipe.tokenizer.decode(whole.token_ids[: n if include else n - 1], skip_special_tokens=True)


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_tokens_text_is_left_out_unless_included(pipe, engine, whole, include) -> None:
    """vLLM leaves a stop id's text out of ``text`` (its id stays in ``token_ids``), unless
    ``include_stop_str_in_output``; streamed, the deltas never hold it either."""
    token, at = stop_token(pipe, whole)
    params = greedy(stop_token_ids=[token], include_stop_str_in_output=include)
    (ran,) = pipe.run(PROMPT, params, progress=False)
    (last,) = streamed(engine, [params])
    for out in (ran, last):
        assert out.token_ids == whole.token_ids[: at + 1] and out.finish_reason == "stop"
        assert out.text == without_stop_token(pipe, whole, at + 1, include)


@pytest.fixture(scope="module")
def ordinary_eos_pipe(qwen2_dir, tmp_path_factory, pipe, whole) -> tuple[OmniJaxPipeline, int, int]:
    """The tiny Qwen2 with an ordinary token of ``whole``'s reply also its EOS (in its
    ``generation_config.json``, as a checkpoint may have it), that token and where it comes."""
    copy = Path(shutil.copytree(qwen2_dir, tmp_path_factory.mktemp("qwen2_ordinary_eos") / "hf"))
    config = json.loads((copy / "generation_config.json").read_text())
    token, at = stop_token(pipe, whole)
    config["eos_token_id"] = [config["eos_token_id"], token]
    (copy / "generation_config.json").write_text(json.dumps(config))
    return OmniJaxPipeline.from_pretrained(copy, **SIZES), token, at


@pytest.mark.parametrize("include", [False, True])
def test_an_ordinary_eos_tokens_text_is_left_out_unless_included(ordinary_eos_pipe, whole, include) -> None:
    pipe, token, at = ordinary_eos_pipe
    params = SamplingParams(temperature=0.0, max_tokens=24, include_stop_str_in_output=include)
    (out,) = pipe.run(PROMPT, params, progress=False)
    assert out.token_ids == whole.token_ids[: at + 1] and out.finish_reason == "stop"
    assert out.text == without_stop_token(pipe, whole, at + 1, include)


@pytest.mark.parametrize(
    "params,match",
    [
        (SamplingParams(stop=["ok", ""]), r"stop strings must not be empty"),
        (SamplingParams(stop=[3]), r"stop=\[3\] must be a str, a list of str or None"),
        (SamplingParams(include_stop_str_in_output=1), r"include_stop_str_in_output=1 must be True or False"),
    ],
    ids=["empty", "not a str", "include not a bool"],
)
def test_bad_stop_params_are_refused_naming_the_field(pipe, params, match) -> None:
    with pytest.raises(ParamError, match=match) as e:
        pipe.run(PROMPT, params, progress=False)
    assert e.value.field in ("stop", "include_stop_str_in_output")


@pytest.fixture(scope="module")
def omni(omni_dir) -> OmniJaxPipeline:
    return OmniJaxPipeline.from_pretrained(omni_dir, max_num_seqs=1)


def test_stop_strings_where_no_text_is_cut_are_refused(omni) -> None:
    """The talker reads the thinker's states as they come, so a reply it speaks cannot be cut
    after it began; the talker writes no text to cut. A text-only request is served."""
    thinker, talker, code2wav = (s.defaults for s in omni.stages)
    cut = SamplingParams(temperature=0.0, max_tokens=4, stop=["x"])
    with pytest.raises(ValueError, match=r"^request 0: stop strings are served for text output only"):
        omni.run("hello", [cut, talker, code2wav], progress=False)
    with pytest.raises(ValueError, match=r"^request 0: stage 'talker': stop strings cut the text stage's"):
        omni.run({"prompt": "hello", "modalities": ["text"]}, [thinker, cut, code2wav], progress=False)
    (out,) = omni.run({"prompt": "hello", "modalities": ["text"]}, [cut, talker, code2wav], progress=False)
    assert out.error is None and out.audio is None


def test_a_spoken_reply_is_the_same_whether_its_stop_tokens_text_is_shown(omni) -> None:
    """The thinker's stop token's text is left out of ``text`` only: the talker reads the
    thinker's whole reply, stop token included, either way, and speaks the same codes."""
    _, talker, _ = (s.defaults for s in omni.stages)
    talker = dataclasses.replace(talker, temperature=0.0, max_tokens=6)
    code2wav = Token2WavParams(num_steps=2, seed=0)
    (free,) = omni.run("hello", [greedy(max_tokens=8), talker, code2wav], progress=False)
    whole = free.stage_outputs["thinker"]
    token, at = stop_token(omni, whole)
    thinker = [
        greedy(max_tokens=8, stop_token_ids=[token], include_stop_str_in_output=i) for i in (False, True)
    ]
    hidden, shown = omni.run(["hello"] * 2, [thinker, talker, code2wav], progress=False)
    for out, include in ((hidden, False), (shown, True)):
        assert out.error is None and out.token_ids == whole.token_ids[: at + 1]
        assert out.text == without_stop_token(omni, whole, at + 1, include)
    assert hidden.text != shown.text
    assert hidden.stage_outputs["talker"].token_ids == shown.stage_outputs["talker"].token_ids
    np.testing.assert_array_equal(hidden.audio, shown.audio)
