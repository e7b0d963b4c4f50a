"""Stop strings (vLLM's ``SamplingParams.stop``): the text stage's reply is cut at the first one.

``StopText`` alone first: any split of a text into deltas sends the text up to the first complete
stop string, holding back a tail that could still become one. Then the engine: ``run()`` and
``generate()`` end a request at the stop string (``finish_reason="stop"``, its KV pages freed at
once), the text cut there (or through it with ``include_stop_str_in_output``), the tokens those
generated up to it; the streamed deltas add up to the cut text. What cannot be served is refused
before any work: stop strings on a stage that writes no text, or on a reply a later stage speaks.
"""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_jax import AsyncOmniJaxPipeline, OmniJaxPipeline, ParamError, SamplingParams
from omni_jax.stop_text import StopText

# -- StopText alone ------------------------------------------------------------------------------


def stream(stops: list[str], deltas: list[str]) -> tuple[str, bool]:
    """What is sent for ``deltas`` (as the engine core drives ``StopText``: ``flush`` after the
    last delta unless a stop string ended the text)."""
    stop = StopText(stops)
    sent = "".join(stop.feed(d) for d in deltas)
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


def first_stop(stops: list[str], deltas: list[str]) -> tuple[str, bool]:
    """The reference: the text so far is searched whole after each delta, and cut at the earliest
    start of the stop strings in it, as soon as one is complete."""
    text = ""
    for delta in deltas:
        text += delta
        found = [text.find(s) for s in stops if s in text]
        if found:
            return text[: min(found)], True
    return text, False


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(alphabet="abc", max_size=30),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=8),
)
def test_any_split_sends_the_text_up_to_the_first_complete_stop_string(
    text: str, stops: list[str], cuts: list[int]
) -> None:
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    assert stream(stops, deltas) == first_stop(stops, deltas)


def test_include_keeps_the_stop_string_and_kept_is_what_was_sent() -> None:
    stop = StopText(["STOP", "ST"], include=True)
    assert stop.feed("a S") == "" and stop.feed("TOP b") == "a ST"  # the earliest, then the shortest
    assert stop.hit and stop.kept == "a ST" and stop.feed("more") == ""
    plain = StopText(["xyz"])
    assert plain.feed("abcxy") + plain.flush() == plain.kept == "abcxy"


# -- the engine ----------------------------------------------------------------------------------

PROMPT = {"prompt_token_ids": [5, 17, 42, 9, 33, 8, 71]}
SIZES = dict(max_num_seqs=2, page_size=8, max_model_len=128)


def greedy(**kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def pipe(qwen2_dir) -> OmniJaxPipeline:
    return OmniJaxPipeline.from_pretrained(qwen2_dir, **SIZES)


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


def test_generate_streams_the_cut_text(qwen2_dir, whole) -> None:
    stop, at = stop_in(whole.text)
    engine = AsyncOmniJaxPipeline.from_pretrained(qwen2_dir, **SIZES)

    async def updates() -> list:
        return [u async for u in engine.generate(PROMPT, greedy(stop=[stop]))]

    try:
        got = asyncio.run(asyncio.wait_for(updates(), 300))
    finally:
        engine.close()
    *before, last = got
    assert last.finished and last.finish_reason == "stop" and last.text == whole.text[:at]
    assert "".join(u.text_delta for u in got) == last.text
    assert [t for u in got for t in u.token_ids_delta] == last.token_ids


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


def test_stop_strings_where_no_text_is_cut_are_refused(omni_dir) -> None:
    """The talker reads the thinker's states as they come, so a reply it speaks cannot be cut
    after it began; the talker writes no text to cut. A text-only request is served."""
    omni = OmniJaxPipeline.from_pretrained(omni_dir, max_num_seqs=1)
    thinker, talker, code2wav = (s.defaults for s in omni.stages)
    cut = SamplingParams(temperature=0.0, max_tokens=4, stop=["x"])
    with pytest.raises(ValueError, match=r"^request 0: stop strings are served for text output only"):
        omni.run("hello", [cut, talker, code2wav], progress=False)
    with pytest.raises(ValueError, match=r"^request 0: stage 'talker': stop strings cut the text stage's"):
        omni.run({"prompt": "hello", "modalities": ["text"]}, [thinker, cut, code2wav], progress=False)
    (out,) = omni.run({"prompt": "hello", "modalities": ["text"]}, [cut, talker, code2wav], progress=False)
    assert out.error is None and out.audio is None
