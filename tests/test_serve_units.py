"""The pieces of ``omni-jax serve`` that need no server and no model: stop strings, how a refused
request body reads, media URLs, WAV in and out, the ``pcm16`` audio format, and how a reply's
end (error, abort) is counted and logged.

``tests/test_serve.py`` drives the same code through a running server; here each piece is held to
what it must do on inputs chosen to break it (a stop string split across deltas, ``..`` out of the
media folder, a byte order), fast enough to run on every change.
"""

from __future__ import annotations

import asyncio
import base64
import io
import logging
import re
import time
import zlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from pydantic import ValidationError
from scipy.io import wavfile

from omni_jax import ParamError, SamplingParams
from omni_jax.audio_io import PCM16_SCALE, pcm16, read_audio_file, wav_bytes
from omni_jax.engine.sampling import MAX_LOGPROBS
from omni_jax.engine_core import EngineStats
from omni_jax.image_io import ImageItemError
from omni_jax.outputs import OmniRequestOutput
from omni_jax.serve import convert, fanout, logprobs, media
from omni_jax.serve.convert import Choice, ServeRequest
from omni_jax.serve.metrics import ServeMetrics
from omni_jax.serve.protocol import (
    MAX_TOP_LOGPROBS,
    ChatCompletionRequest,
    CompletionRequest,
    FieldError,
    ProcessorKwargs,
    invalid_request_message,
)
from omni_jax.serve.reply import End, Piece, Usage, reply
from omni_jax.serve.responses import audio_data
from omni_jax.serve.transcripts import Transcripts
from omni_jax.testing import build_tokenizer

# -- refusals of a request body ---------------------------------------------------------------

CHAT = '{"model": "m", "messages": [{"role": "user", "content": "hi"}]%s}'


def refusal(schema: type, body: str) -> tuple[str, str | None]:
    with pytest.raises(ValidationError) as e:
        schema.model_validate_json(body)
    return invalid_request_message(e.value)


def test_a_field_of_the_wrong_type_is_named_by_its_path() -> None:
    message, param = refusal(ChatCompletionRequest, CHAT % ', "max_tokens": "many"')
    assert param == "max_tokens" and message.startswith("max_tokens: ") and "integer" in message
    message, param = refusal(ChatCompletionRequest, CHAT % ', "temperature": 7')
    assert param == "temperature" and "less than or equal to 2" in message
    for field, literal in (
        ("temperature", "NaN"),
        ("repetition_penalty", "Infinity"),
        ("top_p", "-Infinity"),
    ):
        message, param = refusal(ChatCompletionRequest, CHAT % f', "{field}": {literal}')
        assert (param, message) == (field, f"{field}: Input should be a finite number"), literal
    body = '{"model": "m", "messages": [{"role": "robot", "content": "hi"}]}'
    message, param = refusal(ChatCompletionRequest, body)
    assert param == "messages.0.role" and message.startswith("messages.0.role: ")
    body = CHAT % ', "audio": {"voice": "Ethan", "format": "ogg"}'
    assert refusal(ChatCompletionRequest, body)[1] == "audio.format"


UNION_FIELDS = [
    (
        ChatCompletionRequest,
        '{"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": 3}]}]}',
        "messages.0.content.0.image_url",
    ),
    (
        ChatCompletionRequest,
        '{"model": "m", "messages": [{"role": "user", "content": [{"type": "input_audio", '
        '"input_audio": {"data": "UklGRg==", "format": "ogg"}}]}]}',
        "messages.0.content.0.input_audio.format",
    ),
    (
        ChatCompletionRequest,
        '{"model": "m", "messages": [{"role": "user", "content": 5}]}',
        "messages.0.content",
    ),
    (CompletionRequest, '{"model": "m", "prompt": {"text": "hi"}}', "prompt"),
]


@pytest.mark.parametrize(
    "schema,body,path", UNION_FIELDS, ids=["image part", "audio part", "content number", "prompt object"]
)
def test_a_wrong_value_inside_a_union_field_is_named_by_its_own_path(
    schema: type, body: str, path: str
) -> None:
    message, param = refusal(schema, body)
    assert param == path and message.startswith(f"{param}: ")  # no union member labels, no part tags


def test_an_unknown_field_is_refused_by_name() -> None:
    assert refusal(ChatCompletionRequest, CHAT % ', "frobnicate": 1') == (
        "unsupported field 'frobnicate'",
        "frobnicate",
    )
    # a field OpenAI defines but the server does not serve is refused too, not ignored
    assert refusal(ChatCompletionRequest, CHAT % ', "tools": []')[0] == "unsupported field 'tools'"
    body = '{"model": "m", "messages": [{"role": "user", "content": "hi", "colour": "red"}]}'
    assert refusal(ChatCompletionRequest, body) == (
        "unsupported field 'messages.0.colour'",
        "messages.0.colour",
    )


@pytest.mark.parametrize("schema", [ChatCompletionRequest, CompletionRequest])
def test_n_and_stream_sent_as_null_take_their_defaults(schema: type) -> None:
    """OpenAI types both as nullable, and clients that send every field send them as null: vLLM
    serves such a request (it was a 400 "n: Input should be a valid integer"); a wrong value is
    still refused."""
    body = CHAT if schema is ChatCompletionRequest else '{"model": "m", "prompt": "hi"%s}'
    parsed = schema.model_validate_json(body % ', "n": null, "stream": null')
    assert parsed.n == 1 and parsed.stream is False
    assert refusal(schema, body % ', "n": 0')[1] == "n"
    assert refusal(schema, body % ', "stream": "yes"')[1] == "stream"


def test_openais_stream_options_are_taken() -> None:
    """``include_obfuscation``, which the official client sends to save bytes, is taken (the
    server never pads chunks); an option no one defines is still refused by name."""
    options = '"stream_options": {"include_usage": true, "include_obfuscation": false}'
    parsed = ChatCompletionRequest.model_validate_json(CHAT % f', "stream": true, {options}')
    assert parsed.stream_options is not None and parsed.stream_options.include_usage
    body = CHAT % ', "stream": true, "stream_options": {"obfuscate": false}'
    assert refusal(ChatCompletionRequest, body)[0] == "unsupported field 'stream_options.obfuscate'"


@pytest.mark.parametrize("body", ['{"model": "m", "messages": [', "", "not json", "[1, 2]", '"text"'])
def test_a_body_that_is_not_a_json_object_says_so(body: str) -> None:
    message, param = refusal(ChatCompletionRequest, body)
    assert message.startswith("the body is not a JSON object: ") and param is None


def test_a_missing_field_is_named() -> None:
    message, param = refusal(ChatCompletionRequest, '{"model": "m"}')
    assert param == "messages" and message.startswith("messages: ") and "required" in message.lower()


# -- media URLs -------------------------------------------------------------------------------


def png_bytes(pixels: np.ndarray, mode: str) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels, mode=mode).save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(kind: str, raw: bytes) -> str:
    return f"data:{kind};base64,{base64.b64encode(raw).decode()}"


PIXELS = np.random.default_rng(0).integers(0, 256, (5, 7, 4), dtype=np.uint8)


def test_a_png_data_url_becomes_an_rgb_image() -> None:
    img = media.image(
        "messages.0.content.1.image_url", data_url("image/png", png_bytes(PIXELS, "RGBA")), None
    )
    assert img.mode == "RGB" and img.size == (7, 5)
    np.testing.assert_array_equal(
        np.asarray(img), PIXELS[..., :3]
    )  # a file's alpha is dropped, as load_image
    gray = media.image("x", data_url("image/png", png_bytes(PIXELS[..., 0], "L")), None)
    np.testing.assert_array_equal(np.asarray(gray), np.repeat(PIXELS[..., :1], 3, axis=2))


@pytest.mark.parametrize(
    "url,problem",
    [
        ("data:image/png;base64,iVBOR!!w0KGgo", "not valid base64"),
        ("data:image/png;base64,", "empty"),
        ("data:image/png,iVBORw0KGgo=", "a data URL must be 'data:<type>;base64,<data>'"),
        (data_url("image/png", b"not an image at all"), "not a readable image (no image format recognised)"),
    ],
)
def test_a_bad_image_data_url_is_refused_naming_the_part(url: str, problem: str) -> None:
    with pytest.raises(ValueError, match=r"^messages\.0\.content\.1\.image_url: ") as e:
        media.image("messages.0.content.1.image_url", url, None)
    assert problem in str(e.value)


def test_vllms_audio_url_part_is_read_as_input_audio_is() -> None:
    """The same WAV as an ``audio_url`` data URL and as ``input_audio`` base64: the same item."""
    samples = np.linspace(-0.5, 0.5, 800, dtype=np.float32)
    wav = wav_bytes(samples, 16_000, "float32")
    parts = [
        {"type": "audio_url", "audio_url": {"url": data_url("audio/wav", wav)}},
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}},
        {"type": "text", "text": "what is this"},
    ]
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": parts}]})
    assert body.model is None  # left out: the served model
    items = convert._content("messages.0", body.messages[0], media.MediaReader(), Transcripts().said)
    for item in items[:2]:
        assert item["type"] == "audio" and item["audio"][1] == 16_000
        np.testing.assert_array_equal(item["audio"][0], samples)
    with pytest.raises(ValueError, match=r"^messages\.0\.content\.0\.audio_url: file: URLs are refused"):
        media.audio_file("messages.0.content.0.audio_url", "file:///etc/hostname", None)


def png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width x height`` RGB pixels, with one row of them."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")

    header = width.to_bytes(4, "big") + height.to_bytes(4, "big") + bytes([8, 2, 0, 0, 0])
    pixels = zlib.compress(bytes(1 + 3 * width))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")


def test_an_image_claiming_too_many_pixels_is_refused_naming_the_part() -> None:
    """PIL refuses a header of 400 M pixels as a decompression bomb (not an ``OSError``)."""
    with pytest.raises(ValueError, match=r"^img: not a readable image \(Image size \(400000000 pixels\)"):
        media.image("img", data_url("image/png", png_claiming(20_000, 20_000)), None)


def test_an_image_past_pils_own_bound_is_refused_by_the_servers_limit(monkeypatch) -> None:
    """A header past PIL's bomb bound (twice ``Image.MAX_IMAGE_PIXELS``), which PIL refuses to
    open, is past ``--max-image-pixels`` too: the server's message, naming its limit, nothing
    decoded. Only a limit above PIL's bound leaves PIL's own refusal (the server cannot tell
    whether the image is within its limit)."""
    bomb = data_url("image/png", png_claiming(20_000, 20_000))
    bound = 2 * Image.MAX_IMAGE_PIXELS
    assert 20_000 * 20_000 > bound > 33_554_432  # the server's default limit is within PIL's bound
    decoded = []
    monkeypatch.setattr(media, "upright_rgb", lambda img: decoded.append(img.size) or img.convert("RGB"))
    with pytest.raises(ValueError) as e:
        media.MediaReader().image("messages.0.content.0.image_url", bomb)
    assert str(e.value) == (
        f"messages.0.content.0.image_url: an image of more than {bound} pixels takes the request's images "
        "past the 33554432 pixels left of the server's limit (--max-image-pixels)"
    )
    assert e.value.param == "messages.0.content.0.image_url"
    with pytest.raises(ValueError, match=r"^img: not a readable image \(Image size \(400000000 pixels\)"):
        media.MediaReader(max_image_pixels=bound + 1).image("img", bomb)
    assert decoded == []


def test_a_requests_images_share_a_pixel_budget_checked_before_decoding(monkeypatch) -> None:
    """A few kilobytes of PNG claiming 13000 x 13000 pixels (under PIL's bomb limit) are refused
    from the header, before decoding; a request's images count together."""
    bomb = data_url("image/png", png_claiming(13_000, 13_000))
    assert len(bomb) < 100_000
    decoded = []
    monkeypatch.setattr(media, "upright_rgb", lambda img: decoded.append(img.size) or img.convert("RGB"))
    with pytest.raises(
        ValueError, match=r"^img: an image of 13000x13000 pixels takes .* past the 33554432 pixels"
    ):
        media.MediaReader().image("img", bomb)
    assert decoded == []
    small = data_url("image/png", png_bytes(PIXELS[..., :3], "RGB"))  # 7 x 5
    reader = media.MediaReader(max_image_pixels=60)
    reader.image("a", small)
    with pytest.raises(ValueError, match=r"^b: an image of 7x5 pixels takes .* past the 25 pixels left"):
        reader.image("b", small)
    assert reader.pixels == 35 and decoded == [(7, 5)]
    exact = media.MediaReader(max_image_pixels=70)  # room for two, to the pixel
    exact.image("a", small)
    exact.image("b", small)
    with pytest.raises(ValueError, match=r"^c: an image of 7x5 pixels takes .* past the 0 pixels left"):
        exact.image("c", small)
    np.testing.assert_array_equal(
        np.asarray(media.MediaReader(max_image_pixels=None).image("c", small)), PIXELS[..., :3]
    )


@pytest.mark.parametrize(
    "url", ["http://example.com/cat.png", "https://example.com/cat.png", "ftp://x/y.png"]
)
def test_network_urls_are_refused(url: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="fetches nothing over the network"):
        media.image("img", url, tmp_path)


def test_file_urls_are_read_only_inside_the_allowed_folder(tmp_path: Path) -> None:
    allowed, outside, sibling = tmp_path / "allowed", tmp_path / "secret", tmp_path / "allowed-not"
    (allowed / "sub").mkdir(parents=True)
    outside.mkdir()
    sibling.mkdir()
    raw = png_bytes(PIXELS[..., :3], "RGB")
    (allowed / "sub" / "cat.png").write_bytes(raw)
    (outside / "key.png").write_bytes(raw)
    (sibling / "key.png").write_bytes(raw)
    (allowed / "link.png").symlink_to(outside / "key.png")
    inside = f"file://{allowed}/sub/cat.png"

    with pytest.raises(ValueError, match="refused unless the server names --allowed-local-media-path"):
        media.image("img", inside, None)
    np.testing.assert_array_equal(np.asarray(media.image("img", inside, allowed.resolve())), PIXELS[..., :3])
    for escape in [
        f"file://{outside}/key.png",
        f"file://{allowed}/../secret/key.png",
        f"file://{allowed}/sub/../../secret/key.png",
        f"file://{allowed}/%2E%2E/secret/key.png",  # percent-encoded ..
        f"file://{allowed}/link.png",  # a symlink out of the folder
        f"file://{sibling}/key.png",  # a folder whose name starts with the allowed one's
    ]:
        with pytest.raises(ValueError, match="outside the allowed media folder"):
            media.image("img", escape, allowed.resolve())
    with pytest.raises(ValueError, match="no such file"):
        media.image("img", f"file://{allowed}/sub/dog.png", allowed.resolve())


def test_a_npy_video_data_url_becomes_its_frames() -> None:
    frames = np.random.default_rng(1).integers(0, 256, (3, 4, 6, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    np.save(buffer, frames)
    got = media.video(
        "messages.0.content.0.video_url", data_url("application/octet-stream", buffer.getvalue()), None
    )
    assert got.dtype == frames.dtype
    np.testing.assert_array_equal(got, frames)
    where = "messages.0.content.0.video_url"
    # anything but a .npy file is a video file's bytes, which the processor decodes at the prompt's rate
    mp4 = b"\x00\x00\x00 ftypisom"
    assert media.video(where, data_url("video/mp4", mp4), None) == mp4
    with pytest.raises(ValueError, match=rf"^{re.escape(where)}: not a readable \.npy array of frames"):
        media.video(where, data_url("application/octet-stream", buffer.getvalue()[:-10]), None)  # truncated
    pickled = io.BytesIO()  # a .npy header over a pickle: loading it would run the client's code
    np.save(pickled, np.array([{"frames": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match=rf"^{re.escape(where)}: not a readable .npy array .*allow_pickle"):
        media.video(where, data_url("application/octet-stream", pickled.getvalue()), None)


def test_a_npy_header_claiming_more_than_it_holds_is_refused_before_any_allocation() -> None:
    """A header of a few hundred bytes claiming 27 TiB: numpy would try to allocate them (a
    ``MemoryError``, an HTTP 500); refused from the header, naming what it claims."""
    buffer = io.BytesIO()
    np.save(buffer, np.zeros((1, 1, 1, 3), np.uint8))
    forged = buffer.getvalue().replace(b"(1, 1, 1, 3)", b"(10000000, 1000, 1000, 3)")  # in the padding
    where = "messages.0.content.0.video_url"
    claimed = r"its header claims shape \(10000000, 1000, 1000, 3\) of uint8, 30000000000000 bytes"
    with pytest.raises(
        ValueError, match=rf"^{re.escape(where)}: not a readable \.npy array of frames \({claimed}"
    ):
        media.video(where, data_url("application/octet-stream", forged), None)


@pytest.mark.parametrize(
    ("old", "new", "error"),
    [
        (b"3), }", b"3), ?", "TokenError"),  # an unclosed brace
        (b", 'shape'", b",B'shape'", "TypeError"),  # a bytes key among str keys
    ],
)
def test_a_npy_header_numpy_cannot_parse_is_a_value_error(old, new, error) -> None:
    """numpy parses a ``.npy`` header as a Python literal, and a malformed one raises what the
    tokenizer or its sort of the keys raise (not ``ValueError``: a 500 before this was caught)."""
    buffer = io.BytesIO()
    np.save(buffer, np.zeros((2, 8, 8, 3), np.uint8))
    assert old in buffer.getvalue()
    where = "messages.0.content.0.video_url"
    with pytest.raises(
        ValueError, match=rf"^{re.escape(where)}: not a readable \.npy array of frames \({error}: "
    ):
        media.video(where, data_url("application/octet-stream", buffer.getvalue().replace(old, new)), None)


MALFORMED_PNG_EXIF = (
    "iVBORw0KGgoAAAANSUhEUgAAAAIAAAACCAIAAAD91JpzAAAACGVYSWZnYXJiYWdlIYyZkTkAAAALSURBVHicY2BABgAADgABqZ"
    "FzsQAAAABJRU5ErkJggg=="
)
"""A 2x2 PNG whose ``eXIf`` chunk is garbage: PIL's EXIF parser raises ``SyntaxError``."""
ZERO_CHANNEL_WAV = "UklGRjgAAABXQVZFZm10IBAAAAABAAAAgD4AAAB9AAACABAAZGF0YRQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=="
"""A WAV whose header says 0 channels: scipy's reader divides by them (``ZeroDivisionError``)."""


def test_media_a_parser_fails_on_in_its_own_way_is_refused_naming_the_part() -> None:
    """PIL and scipy raise errors of their own on some malformed files (``SyntaxError``,
    ``ZeroDivisionError``), not ``OSError`` or ``ValueError``: they were HTTP 500s; now each is
    the part's 400, naming the parser's error."""
    where = "messages.0.content.0.image_url"
    with pytest.raises(ValueError, match=rf"^{re.escape(where)}: not a readable image \(SyntaxError: "):
        media.image(where, f"data:image/png;base64,{MALFORMED_PNG_EXIF}", None)
    where = "messages.0.content.0.input_audio.data"
    with pytest.raises(
        FieldError,
        match=rf"^{re.escape(where)}: the audio file is not a readable WAV file: ZeroDivisionError",
    ):
        media.audio(where, ZERO_CHANNEL_WAV)


def test_input_audio_is_the_wav_file_it_carries() -> None:
    """Decoded to ``(samples, rate)`` at the file's own rate, so that a file that cannot be read
    is refused naming its field (the stage refused it with ``param: null``)."""
    samples = np.linspace(-1, 1, 50, dtype=np.float32)
    raw = wav_bytes(samples, 8_000, "float32")
    got, rate = media.audio("a", base64.b64encode(raw).decode())
    assert rate == 8_000
    np.testing.assert_array_equal(got, samples)
    where = "messages.0.content.2.input_audio.data"
    with pytest.raises(ValueError, match=rf"^{re.escape(where)}: not valid base64"):
        media.audio(where, "UklGR@@@")
    with pytest.raises(FieldError, match=rf"^{re.escape(where)}: the audio file is not a readable WAV file"):
        media.audio(where, base64.b64encode(raw[:30]).decode())
    with pytest.raises(FieldError, match=rf"^{re.escape(where)}: the audio file holds no samples$"):
        media.audio(where, base64.b64encode(wav_bytes(np.zeros(0, np.float32), 16_000)).decode())


# -- WAV in and out ---------------------------------------------------------------------------


def test_a_wav_round_trip_is_pcm16_quantisation() -> None:
    rng = np.random.default_rng(2)
    samples = np.concatenate([rng.uniform(-1.2, 1.2, 997), [1.0, -1.0, 0.5, 1.5, -3.0]]).astype(np.float32)
    raw = wav_bytes(samples, 24_000)
    rate, data = wavfile.read(io.BytesIO(raw))
    assert rate == 24_000 and data.dtype == np.int16
    np.testing.assert_array_equal(data, pcm16(samples))
    assert pcm16(np.float32([1.0, -1.0, 2.0, -2.0])).tolist() == [PCM16_SCALE, -PCM16_SCALE] * 2
    back = read_audio_file(io.BytesIO(raw), 24_000)
    assert back.dtype == np.float32
    np.testing.assert_array_equal(back, pcm16(samples).astype(np.float32) / 32768)
    # written at 32767 full scale, read at 32768 (libsndfile's convention): round(c * 32767) / 32768
    # - c = (e - c) / 32768 with |e| <= 1/2 the rounding and |c| <= 1, so at most 1.5 / 32768
    np.testing.assert_allclose(back, np.clip(samples, -1, 1), rtol=0, atol=1.5 / 32768)
    # float32 WAVs keep the samples as they are
    np.testing.assert_array_equal(
        read_audio_file(io.BytesIO(wav_bytes(samples, 24_000, "float32")), 24_000), samples
    )


@pytest.mark.parametrize("rate,factor", [(16_000, 2), (24_000, 3)])
def test_audio_at_8khz_is_resampled_to_the_rate_asked(rate: int, factor: int) -> None:
    seconds, freq = 0.5, 440.0
    t = np.arange(int(8_000 * seconds)) / 8_000
    raw = wav_bytes((0.5 * np.sin(2 * np.pi * freq * t)).astype(np.float32), 8_000)
    audio = read_audio_file(io.BytesIO(raw), rate)
    assert audio.dtype == np.float32 and audio.shape == (t.size * factor,)
    spectrum = np.abs(np.fft.rfft(audio))
    assert np.fft.rfftfreq(audio.size, 1 / rate)[spectrum.argmax()] == pytest.approx(freq, abs=2.0)


def test_a_stereo_wav_is_averaged_and_an_empty_one_refused() -> None:
    buffer = io.BytesIO()
    wavfile.write(buffer, 16_000, np.array([[1000, 3000], [-2000, 0]], np.int16))
    np.testing.assert_array_equal(
        read_audio_file(io.BytesIO(buffer.getvalue()), 16_000), np.float32([2000, -1000]) / 32768
    )
    empty = io.BytesIO()
    wavfile.write(empty, 16_000, np.zeros(0, np.int16))
    with pytest.raises(ValueError, match="holds no samples"):
        read_audio_file(io.BytesIO(empty.getvalue()), 16_000)
    with pytest.raises(ValueError, match="is not a readable WAV file"):
        read_audio_file(io.BytesIO(b"RIFF....WAVE"), 16_000)
    with pytest.raises(ValueError, match="is not a media file FFmpeg can read"):  # not told to be a WAV
        read_audio_file(io.BytesIO(b"RIFF...."), 16_000)


def test_a_truncated_wav_is_not_a_readable_one() -> None:
    """scipy reads a header cut short with ``struct`` and raises its error, not a ``ValueError``."""
    with pytest.raises(ValueError, match="is not a readable WAV file: unpack requires a buffer"):
        read_audio_file(io.BytesIO(wav_bytes(np.zeros(100, np.float32), 16_000)[:30]), 16_000)


@pytest.mark.parametrize("rate", [999, 384_001, 2**31 - 1])
def test_a_rate_outside_what_audio_is_recorded_at_is_refused_before_resampling(rate: int) -> None:
    """A header's rate is the sender's word; resampling from a prime rate of millions of Hz takes
    seconds and gigabytes, so it is refused before any."""
    buffer = io.BytesIO()
    wavfile.write(buffer, 16_000, np.full(1000, 128, np.uint8))  # one byte a frame: byte rate = rate
    raw = buffer.getvalue()
    forged = raw[:24] + rate.to_bytes(4, "little") * 2 + raw[32:]
    with pytest.raises(
        ValueError, match=f"^has a sample rate of {rate} Hz; audio is read at 1000 to 384000 Hz$"
    ):
        read_audio_file(io.BytesIO(forged), 16_000)


def test_a_wav_over_the_length_asked_is_refused_before_resampling(monkeypatch) -> None:
    """1.5 s at 8 kHz against 1 s: refused from its header's rate, resampling never called."""
    import scipy.signal

    def never(*args: Any) -> None:
        raise AssertionError("resampled")

    monkeypatch.setattr(scipy.signal, "resample_poly", never)
    raw = wav_bytes(np.zeros(12_000, np.float32), 8_000)
    with pytest.raises(
        ValueError, match=r"^is 1\.50 s long \(12000 samples at 8000 Hz\), over the 1 s it may last$"
    ):
        read_audio_file(io.BytesIO(raw), 16_000, max_seconds=1)
    assert (
        read_audio_file(
            io.BytesIO(wav_bytes(np.zeros(8_000, np.float32), 16_000)), 16_000, max_seconds=1
        ).size
        == 8_000
    )


def test_pcm16_audio_data_is_little_endian_int16_samples() -> None:
    samples = np.float32([0.5, -0.5, 1.0, -1.0, 0.0, 0.25, 3.0])
    raw = base64.b64decode(audio_data(samples, 24_000, "pcm16"))
    assert len(raw) == 2 * samples.size
    np.testing.assert_array_equal(np.frombuffer(raw, "<i2"), pcm16(samples))
    assert raw[:2] == int(pcm16(samples)[0]).to_bytes(2, "little", signed=True) == bytes([0x00, 0x40])
    # "wav" is a whole WAV file of the same samples
    rate, data = wavfile.read(io.BytesIO(base64.b64decode(audio_data(samples, 24_000, "wav"))))
    assert rate == 24_000
    np.testing.assert_array_equal(data, pcm16(samples))


# -- log-probabilities ---------------------------------------------------------------------------

TOKENIZER = build_tokenizer(448)  # byte-level BPE with Qwen's chat specials, as the tiny checkpoints'

ENTRIES = [
    {7: -2.5, 3: -0.5, 9: -1.0},  # sampled 7, outside the top 2
    {3: -0.1, 9: -3.0},  # sampled 3, the most likely (one entry fewer)
]


def test_the_schema_bound_is_the_engines() -> None:
    """The schema refuses what the engine would (a request past it gets the field's name)."""
    assert MAX_TOP_LOGPROBS == MAX_LOGPROBS


def test_chat_logprobs_put_the_sampled_token_first_and_the_most_likely_in_order() -> None:
    text = lambda t: "é" if t == 9 else f"t{t}"  # noqa: E731
    got = logprobs.chat(ENTRIES, 2, logprobs.TokenReader(text, lambda t: text(t).encode()))
    assert got["refusal"] is None
    first, second = got["content"]
    assert (first["token"], first["logprob"], first["bytes"]) == ("t7", -2.5, [116, 55])
    assert [(t["token"], t["logprob"]) for t in first["top_logprobs"]] == [("t3", -0.5), ("é", -1.0)]
    assert first["top_logprobs"][1]["bytes"] == [0xC3, 0xA9]
    assert [(t["token"], t["logprob"]) for t in second["top_logprobs"]] == [("t3", -0.1), ("é", -3.0)]
    none = logprobs.chat(ENTRIES, 0, logprobs.token_reader(None))
    assert [e["top_logprobs"] for e in none["content"]] == [[], []]
    assert none["content"][0]["bytes"] == list(b"token_id:7")


def test_completion_logprobs_count_text_offsets_on_across_pieces() -> None:
    lists = logprobs.CompletionLogprobs(1, logprobs.token_reader(None))
    first = lists.json(ENTRIES[:1])
    assert first == {
        "tokens": ["token_id:7"],
        "token_logprobs": [-2.5],
        "top_logprobs": [{"token_id:7": -2.5, "token_id:3": -0.5}],
        "text_offset": [0],
    }
    assert lists.json(ENTRIES[1:])["text_offset"] == [len("token_id:7")]


@pytest.mark.parametrize(
    "top,want",
    [
        (0, [{"t7": -2.5}, {"t3": -0.1}]),
        (1, [{"t7": -2.5, "t3": -0.5}, {"t3": -0.1}]),
        (2, [{"t7": -2.5, "t3": -0.5, "t9": -1.0}, {"t3": -0.1, "t9": -3.0}]),
    ],
)
def test_completion_top_logprobs_hold_the_sampled_token_and_the_most_likely(
    top: int, want: list[dict[str, float]]
) -> None:
    """vLLM's ``/v1/completions`` (and OpenAI's legacy API: "up to logprobs + 1" entries): each
    ``top_logprobs`` entry is the sampled token, then the ``logprobs`` most likely, once each; with
    ``logprobs: 0``, the sampled token alone, not an empty dict."""
    reader = logprobs.TokenReader(lambda t: f"t{t}", lambda t: f"t{t}".encode())
    got = logprobs.CompletionLogprobs(top, reader).json(ENTRIES)["top_logprobs"]
    assert [list(entry.items()) for entry in got] == [list(entry.items()) for entry in want]


def test_the_byte_level_alphabet_is_the_tokenizers() -> None:
    from tokenizers import pre_tokenizers

    alphabet = logprobs.byte_level_alphabet()
    assert set(alphabet) == set(pre_tokenizers.ByteLevel.alphabet())
    assert sorted(alphabet.values()) == list(range(256))
    assert alphabet["A"] == ord("A") and alphabet["Ġ"] == ord(" ") and alphabet["Ċ"] == ord("\n")


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, len(TOKENIZER) - 1), min_size=1, max_size=12))
def test_token_bytes_joined_are_the_texts_bytes(ids: list[int]) -> None:
    """OpenAI's ``bytes``: any tokens' bytes, joined, decode to the tokenizer's text of them (a
    character split across tokens, or a chat special, included): what a client rebuilds the
    text from where a token alone is part of a character."""
    reader = logprobs.token_reader(TOKENIZER)
    joined = b"".join(reader.raw(i) for i in ids)
    assert joined.decode("utf-8", errors="replace") == TOKENIZER.decode(ids)
    for i in ids:
        try:
            assert reader.text(i) == reader.raw(i).decode("utf-8")
        except UnicodeDecodeError:
            assert reader.text(i) == "bytes:" + "".join(f"\\x{b:02x}" for b in reader.raw(i))


def test_pieces_of_a_character_read_apart() -> None:
    """A token holding part of a character reads as OpenAI writes it, ``bytes:`` and its bytes,
    so that a completion's ``top_logprobs`` keeps one key per token (U+FFFD for each, vLLM's
    reading, kept one), and ``text_offset`` places the character's pieces where it starts."""
    lead, tail = (TOKENIZER.convert_tokens_to_ids(c) for c in ("Ã", "©"))  # é's two bytes
    h = TOKENIZER.convert_tokens_to_ids("h")
    reader = logprobs.token_reader(TOKENIZER)
    assert (reader.text(lead), reader.text(tail), reader.text(h)) == ("bytes:\\xc3", "bytes:\\xa9", "h")
    lists = logprobs.CompletionLogprobs(3, reader)
    got = lists.json([{lead: -0.5, tail: -0.6, h: -0.7}, {tail: -0.1}, {h: -0.2}])
    assert got["top_logprobs"][0] == {"bytes:\\xc3": -0.5, "bytes:\\xa9": -0.6, "h": -0.7}
    assert got["text_offset"] == [0, 0, 1]  # "é" starts at 0, "h" after it


# -- a reply's end and its metrics ---------------------------------------------------------------


class _Pipe:
    """Stands in for ``AsyncOmniJaxPipeline.generate``: yields ``updates``, and records whether
    the consumer closed it (what aborts a request in the engine)."""

    def __init__(self, updates: list[OmniRequestOutput]):
        self.updates = updates
        self.closed = False

    async def generate(
        self,
        prompt: Any,
        params: Any,
        request_id: str,
        *,
        within_context: bool = False,
        admitted: asyncio.Event | None = None,
    ) -> AsyncIterator[OmniRequestOutput]:
        try:
            if admitted is not None:
                admitted.set()
            for update in self.updates:
                yield update
        finally:
            self.closed = True


def _metrics() -> ServeMetrics:
    return ServeMetrics(lambda: EngineStats(0, {}, 0), lambda: 0, lambda: 0)


def _count(metrics: ServeMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels or None)
    return 0.0 if value is None else value


def _serve_request() -> Choice:
    return Choice({"prompt": "hi"}, [])


def test_a_failed_request_ends_with_its_error_counted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    """A stage's failure reaches the reply's end (what the client gets) and the server's log
    (what the operator reads), and counts as an ``error`` ending."""
    updates = [
        OmniRequestOutput("r", [1, 2, 3], token_ids_delta=[7], text_delta="a"),
        OmniRequestOutput(
            "r", [1, 2, 3], finish_reason="error", error="stage 'code2wav': too long", finished=True
        ),
    ]
    metrics = _metrics()

    async def read() -> list[Piece | End]:
        return [e async for e in reply(_Pipe(updates), _serve_request(), "chatcmpl-1", metrics, 0.0)]

    with caplog.at_level(logging.WARNING, logger="omni_jax.serve"):
        events = asyncio.run(read())
    end = events[-1]
    assert isinstance(end, End) and (end.finish_reason, end.error) == ("error", "stage 'code2wav': too long")
    assert end.usage == Usage(3, 1)
    assert "request chatcmpl-1 failed: stage 'code2wav': too long" in caplog.text
    assert _count(metrics, "omni_jax:request_success_total", finish_reason="error") == 1
    assert _count(metrics, "omni_jax:prompt_tokens_total") == 3
    assert _count(metrics, "omni_jax:generation_tokens_total") == 1


@pytest.mark.parametrize("after", [1, 2], ids=["first piece", "second piece"])
def test_a_reply_closed_before_its_end_counts_as_aborted_with_its_work(after: int) -> None:
    """The client gone after ``after`` pieces: the request counts as ended with ``abort``, its
    prompt and the tokens it made so far counted, the pipeline's generator closed (the engine
    aborts it); no other ending counted."""
    updates = [
        OmniRequestOutput("r", [1, 2, 3, 4], token_ids_delta=[7, 8], text_delta="ab"),
        OmniRequestOutput("r", [1, 2, 3, 4], token_ids_delta=[9], text_delta="c"),
        OmniRequestOutput("r", [1, 2, 3, 4], finish_reason="length", finished=True),
    ]
    pipe, metrics = _Pipe(updates), _metrics()

    async def read_some() -> None:
        events = reply(pipe, _serve_request(), "chatcmpl-2", metrics, 0.0)
        for _ in range(after):
            await anext(events)
        await events.aclose()

    asyncio.run(read_some())
    assert pipe.closed
    assert _count(metrics, "omni_jax:request_success_total", finish_reason="abort") == 1
    assert _count(metrics, "omni_jax:request_success_total", finish_reason="length") == 0
    assert _count(metrics, "omni_jax:prompt_tokens_total") == 4
    assert _count(metrics, "omni_jax:generation_tokens_total") == [2, 3][after - 1]


def test_a_reply_read_to_its_end_is_not_aborted_when_closed() -> None:
    """Closing the iterator after its ``End`` (as the routes do) counts nothing more."""
    updates = [OmniRequestOutput("r", [1], token_ids_delta=[5], finish_reason="stop", finished=True)]
    metrics = _metrics()

    async def read_all() -> None:
        events = reply(_Pipe(updates), _serve_request(), "chatcmpl-3", metrics, 0.0)
        while not isinstance(await anext(events), End):
            pass
        await events.aclose()

    asyncio.run(read_all())
    assert _count(metrics, "omni_jax:request_success_total", finish_reason="stop") == 1
    assert _count(metrics, "omni_jax:request_success_total", finish_reason="abort") == 0


def test_a_client_gone_mid_upload_is_a_499_not_a_server_error() -> None:
    """starlette raises ``ClientDisconnect`` when the body stops short: the client reads nothing,
    so it is the log's 499 (and no traceback), as for a client gone while its reply was made."""
    from starlette.requests import Request

    from omni_jax.serve.app import CLIENT_GONE, HTTPError, ServeSettings, _Server

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    request = Request({"type": "http", "method": "POST", "headers": [(b"content-length", b"1000")]}, receive)
    server = _Server(None, ServeSettings(model_name="m"))  # type: ignore[arg-type]  # the body alone
    with pytest.raises(HTTPError) as e:
        asyncio.run(server.body(request))
    assert e.value.status == CLIENT_GONE


class _Warming:
    """A pipeline whose warm-up ends only when ``finish`` is set (``None``: never)."""

    def __init__(self, finish: bool) -> None:
        from types import SimpleNamespace

        self.pipeline = SimpleNamespace(tokenizer=None, stages=[])
        self.running, self.closed, self.finish = True, False, finish

    async def warmup(self, progress: bool = False) -> Any:
        from omni_jax.outputs import WarmupReport

        if not self.finish:
            await asyncio.Event().wait()
        return WarmupReport({})

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("finish", [False, True], ids=["during warm-up", "after it"])
def test_a_shutdown_during_warm_up_does_not_wait_for_it(finish: bool) -> None:
    """SIGTERM while compiling (minutes on a real checkpoint) ends the server at once, leaving
    the warm-up to end with the process; after the warm-up the pipeline is closed as usual."""
    from fastapi.testclient import TestClient

    from omni_jax.serve.app import ServeSettings, build_app

    pipe = _Warming(finish)
    with TestClient(build_app(pipe, ServeSettings(model_name="m"))) as client:  # type: ignore[arg-type]
        for _ in range(100):  # the warm-up task runs once the app has started
            if not finish or client.get("/health").status_code == 200:
                break
    assert pipe.closed is finish


def test_a_stopped_engine_is_a_503_on_health_and_on_every_request() -> None:
    """An engine thread that has died (a fault, or the pipeline closed under the server) answers
    each request with a 503 saying so, before its body is read, and ``/health`` turns 503 with
    the reason: a load balancer takes the replica out instead of sending it more work."""
    from fastapi.testclient import TestClient

    from omni_jax.serve.app import ServeSettings, build_app

    pipe = _Warming(finish=True)
    with TestClient(build_app(pipe, ServeSettings(model_name="m"))) as client:  # type: ignore[arg-type]
        for _ in range(100):
            if client.get("/health").status_code == 200:
                break
        assert client.get("/health").status_code == 200
        pipe.running = False
        r = client.get("/health")
        assert (r.status_code, r.json()) == (503, {"status": "engine stopped"})
        for path in ("/v1/chat/completions", "/v1/completions", "/tokenize"):
            r = client.post(path, content=b"not even JSON")
            assert r.status_code == 503, (path, r.text)
            assert r.json()["error"]["message"] == "the engine has stopped", path


class _Faulty(_Warming):
    """A warm pipeline whose stats fail: ``GET /metrics`` meets an exception no handler takes."""

    def __init__(self) -> None:
        super().__init__(finish=True)

    @property
    def stats(self) -> Any:
        raise RuntimeError("injected fault")


def test_an_unhandled_fault_is_a_500_json_and_the_server_goes_on() -> None:
    """Starlette re-raised such an exception after answering (a second traceback, and uvicorn
    closed the client's connection); now it is answered inside the app and the same client's
    next request is served."""
    from fastapi.testclient import TestClient

    from omni_jax.serve.app import ServeSettings, build_app

    with TestClient(build_app(_Faulty(), ServeSettings(model_name="m"))) as client:  # type: ignore[arg-type]
        r = client.get("/metrics")
        assert r.status_code == 500
        assert r.json()["error"] == {
            "message": "internal error: RuntimeError('injected fault')",
            "type": "internal_error",
            "param": None,
            "code": 500,
        }
        assert client.get("/health").status_code in (200, 503)


def _cut(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the client gets when the shutdown cancels an app after it sent ``messages``."""
    from omni_jax.serve.app import _Contained

    async def app(scope: Any, receive: Any, send: Any) -> None:
        for message in messages:
            await send(message)
        raise asyncio.CancelledError

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions"}
    asyncio.run(_Contained(app, lambda: None)(scope, None, send))  # type: ignore[arg-type]
    return sent


def test_a_stream_the_shutdown_cuts_ends_with_an_error_event_unless_it_had_ended() -> None:
    """Cut mid-stream: an ``error`` event (503) and ``[DONE]`` end the body. Cut after the last
    byte went out (as the response's task group ends): nothing more is sent; a body after the
    end was uvicorn's "Unexpected ASGI message" traceback."""
    start = {
        "type": "http.response.start",
        "status": 200,
        "headers": [(b"content-type", b"text/event-stream")],
    }
    chunk = {"type": "http.response.body", "body": b'data: {"x":1}\n\n', "more_body": True}
    cut = _cut([start, chunk])
    assert cut[:2] == [start, chunk] and len(cut) == 3 and cut[2]["more_body"] is False
    said = b'data: {"error":{"message":"the server is shutting down: the stream was cut",'
    assert cut[2]["body"].startswith(said) and cut[2]["body"].endswith(b"\n\ndata: [DONE]\n\n")
    end = {"type": "http.response.body", "body": b"", "more_body": False}
    assert _cut([start, chunk, end]) == [start, chunk, end]


@pytest.mark.parametrize("server_asgi", ["2.3", "2.4"])
def test_a_stream_whose_client_went_away_is_logged_once_not_failed(
    server_asgi: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A stream that stops before its last byte because its client went away (under ASGI 2.3
    Starlette's response returns; under 2.4 it raises ``ClientDisconnect``) is logged in one line
    naming the request, as a whole reply's is; nothing more is sent and no failure is counted. A
    stream that ends is not logged."""
    from starlette.requests import ClientDisconnect

    from omni_jax.serve.app import REQUEST_ID_STATE, _Contained

    start = {
        "type": "http.response.start",
        "status": 200,
        "headers": [(b"content-type", b"text/event-stream")],
    }
    chunk = {"type": "http.response.body", "body": b'data: {"x":1}\n\n', "more_body": True}
    end = {"type": "http.response.body", "body": b"", "more_body": False}

    def serve(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
        async def app(scope: Any, receive: Any, send: Any) -> None:
            scope["state"][REQUEST_ID_STATE] = "chatcmpl-7"  # as the route leaves it
            for message in messages:
                await send(message)
            if messages[-1] is not end and server_asgi == "2.4":
                raise ClientDisconnect

        sent: list[dict[str, Any]] = []
        failures = []

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "state": {}}
        asyncio.run(_Contained(app, lambda: failures.append(1))(scope, None, send))  # type: ignore[arg-type]
        return sent, len(failures)

    gone = "chatcmpl-7: client disconnected; its request was aborted"
    with caplog.at_level(logging.INFO, logger="omni_jax.serve"):
        assert serve([start, chunk]) == ([start, chunk], 0)
        assert caplog.text.count(gone) == 1
        assert serve([start, chunk, end]) == ([start, chunk, end], 0)
    assert caplog.text.count(gone) == 1


def test_transcripts_are_kept_until_their_audio_expires_and_at_most_so_many() -> None:
    """A spoken reply's transcript answers for its audio id until ``expires_at``; past the
    bound the oldest goes first, so the server's memory holds whatever the traffic."""
    now = [100.0]
    kept = Transcripts(limit=2, clock=lambda: now[0])
    kept.keep("audio-a", "one", expires_at=110)
    kept.keep("audio-b", "two", expires_at=200)
    assert (kept.said("audio-a"), kept.said("audio-b"), kept.said("audio-c")) == ("one", "two", None)
    now[0] = 110.0
    assert kept.said("audio-a") is None and kept.said("audio-b") == "two"
    kept.keep("audio-c", "three", expires_at=200)
    kept.keep("audio-d", "four", expires_at=200)
    assert (kept.said("audio-b"), kept.said("audio-c"), kept.said("audio-d")) == (None, "three", "four")


# -- several replies as one response (fanout) ----------------------------------------------------


async def _slow(
    closed: list[str], name: str, admitted: asyncio.Event | None = None, first: float = 0.0
) -> AsyncIterator[Piece | End]:
    """A reply admitted at once, its first token ``first`` seconds later, that takes 10 s more
    to end; records being closed."""
    try:
        if admitted is not None:
            admitted.set()
        await asyncio.sleep(first)
        for _ in range(1000):
            await asyncio.sleep(0.01)
            yield Piece("a")
        yield End("length", Usage(1, 1000))
    finally:
        closed.append(name)


async def _failing(closed: list[str]) -> AsyncIterator[Piece | End]:
    try:
        yield End("error", Usage(1, 0), "stage 'llm': non-finite logits")
    finally:
        closed.append("failing")


async def _refused() -> AsyncIterator[Piece | End]:
    raise ValueError("request 0: empty prompt")
    yield End("stop", Usage(0, 0))  # an async generator, refused at its first step


def _signals(n: int) -> list[asyncio.Event]:
    return [asyncio.Event() for _ in range(n)]


def test_a_request_is_admitted_without_waiting_for_its_first_tokens() -> None:
    """A reply queued behind a full batch is admitted long before its first token: the others'
    text must not wait for it."""

    async def main() -> float:
        closed: list[str] = []
        signals = _signals(2)
        replies = [_slow(closed, "a", signals[0], first=30), _slow(closed, "b", signals[1], first=30)]
        start = time.perf_counter()
        firsts = await fanout.admit(replies, signals)
        took = time.perf_counter() - start
        await fanout.end(firsts, replies)
        assert sorted(closed) == ["a", "b"]
        return took

    assert asyncio.run(main()) < 10  # each first token is 30 s away


def test_one_reply_refused_closes_the_others_and_refuses_the_request() -> None:
    """The refusal names the reply refused, so that the request's 400 can name its prompt."""

    async def main() -> list[str]:
        closed: list[str] = []
        signals = _signals(2)
        with pytest.raises(fanout.Refused) as e:
            await fanout.admit([_slow(closed, "a", signals[0]), _refused()], signals)
        assert e.value.index == 1
        assert isinstance(e.value.error, ValueError) and str(e.value.error) == "request 0: empty prompt"
        return list(closed)  # as the loop runs on: asyncio.run's end closes what is left

    assert asyncio.run(main()) == ["a"]


def _completion(prompts: int, n: int) -> ServeRequest:
    """What a completion of ``prompts`` prompts (a list of them), ``n`` choices each, asks."""
    params = SamplingParams()
    return ServeRequest(
        [{"prompt": "hi"}] * prompts,
        params,
        None,
        False,
        False,
        False,
        n=n,
        prompt_field="prompt",
        listed=True,
    )


def test_a_refused_prompt_of_several_is_named_by_its_place() -> None:
    """Choice 5 of three prompts with ``n=2`` each is the third prompt's: ``prompt.2``, as the
    schema names a list's item, in the message too; a prompt alone (a chat's, or a completion's
    single prompt) is named by its field, as OpenAI's context-length errors are."""
    from omni_jax.serve.app import _refusal

    too_long = ValueError("request 0: prompt has 17000 tokens, max_model_len is 16384")
    refused = _refusal(fanout.Refused(5, too_long), _completion(3, 2))
    assert (refused.status, refused.param) == (400, "prompt.2")
    assert refused.message == "prompt.2: prompt has 17000 tokens, max_model_len is 16384"
    alone = ServeRequest(
        [{"prompt": "hi"}], SamplingParams(), None, False, False, False, prompt_field="prompt"
    )
    refused = _refusal(fanout.Refused(0, too_long), alone)
    assert (refused.param, refused.message) == ("prompt", "prompt has 17000 tokens, max_model_len is 16384")
    past = ParamError("stage 'llm': max_tokens=9 does not fit", "max_tokens")
    assert _refusal(fanout.Refused(3, past), _completion(3, 2)).param == "max_tokens"  # a field of all


def test_an_image_the_processor_refuses_is_named_by_its_content_part() -> None:
    """The processor says which of the prompt's images it refuses (:class:`ImageItemError`);
    the server names the content part that image came from, as it names a part it cannot read."""
    from omni_jax.serve.app import _refusal

    parts = [
        {"type": "image_url", "image_url": {"url": data_url("image/png", png_bytes(PIXELS[..., :3], "RGB"))}},
        {"type": "text", "text": "and this"},
        {
            "type": "image_url",
            "image_url": {"url": data_url("image/png", png_bytes(PIXELS[:1, :, :3], "RGB"))},
        },
    ]
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": parts}]})
    reader = media.MediaReader()
    convert.chat_messages(body.messages, reader, Transcripts().said)
    assert reader.image_parts == ["messages.0.content.0.image_url", "messages.0.content.2.image_url"]
    chat = ServeRequest(
        [{}], SamplingParams(), None, False, False, False, image_parts=tuple(reader.image_parts)
    )
    wide = ImageItemError(0, 1, "absolute aspect ratio must be smaller than 200, got 250.0")
    refused = _refusal(fanout.Refused(0, wide), chat)
    assert (refused.status, refused.param) == (400, "messages.0.content.2.image_url")
    assert (
        refused.message
        == "messages.0.content.2.image_url: absolute aspect ratio must be smaller than 200, got 250.0"
    )


def test_what_is_no_refusal_is_raised_as_it_came() -> None:
    from omni_jax.serve.app import _refusal

    broken = RuntimeError("the engine is closed")
    with pytest.raises(RuntimeError) as e:
        _refusal(fanout.Refused(0, broken), _completion(1, 1))
    assert e.value is broken


def test_a_failed_reply_ends_its_siblings_at_once() -> None:
    """A whole response: the first reply a stage failed is answered at once (a 500 naming its
    choice), and the replies still running are aborted, not read to their end."""

    async def main() -> tuple[list[fanout.Gathered], list[str], float]:
        closed: list[str] = []
        signals = _signals(2)
        replies = [_slow(closed, "slow", signals[0]), _failing(closed)]
        signals[1].set()
        start = time.perf_counter()
        got = await fanout.gathered(replies, await fanout.admit(replies, signals))
        return got, list(closed), time.perf_counter() - start  # before asyncio.run closes the rest

    got, closed, took = asyncio.run(main())
    assert [(g.index, g.end.error) for g in got] == [(1, "stage 'llm': non-finite logits")]
    assert sorted(closed) == ["failing", "slow"] and took < 1


def test_a_stream_closed_early_closes_every_reply() -> None:
    async def main() -> list[str]:
        closed: list[str] = []
        signals = _signals(3)
        replies = [_slow(closed, name, s) for name, s in zip("abc", signals, strict=True)]
        events = fanout.merged(replies, await fanout.admit(replies, signals))
        seen = [await anext(events) for _ in range(5)]
        assert {index for index, _ in seen} <= {0, 1, 2}
        await events.aclose()
        return list(closed)  # before asyncio.run closes the rest

    assert sorted(asyncio.run(main())) == ["a", "b", "c"]


def test_n_replies_are_seeded_apart_as_64_bit_words() -> None:
    """Reply ``j`` draws from the seed plus ``j`` as a 64-bit word: ``-2`` moved on by one is
    not ``-1`` (vLLM's no seed), the largest seed wraps to 0, and ``-1`` stays unseeded."""

    def seeded(given: int) -> list[int | None]:
        request = ServeRequest([{"prompt": "hi"}], SamplingParams(seed=given), None, False, False, False, n=3)
        return [c.sampling_params_list.seed for c in request.choices()]  # type: ignore[union-attr]

    seeds = {given: seeded(given) for given in (5, -2, 2**64 - 1, -1)}
    assert seeds == {5: [5, 6, 7], -2: [-2, 2**64 - 1, 0], 2**64 - 1: [2**64 - 1, 0, 1], -1: [-1, -1, -1]}


SAMPLING_VALUES = {
    "temperature": 0.5,
    "top_p": 0.5,
    "top_k": 3,
    "min_p": 0.1,
    "repetition_penalty": 1.2,
    "presence_penalty": 0.3,
    "frequency_penalty": -0.4,
    "min_tokens": 2,
    "seed": 5,
    "stop_token_ids": [7, 9],
    "ignore_eos": True,
    "include_stop_str_in_output": True,
}
"""A value other than the default for each sampling field a request may give."""


def test_every_sampling_field_of_a_request_reaches_the_text_stage() -> None:
    """Each field :data:`~omni_jax.serve.convert.SAMPLING_FIELDS` names arrives in the text
    stage's params (a field left out of the list is silently dropped: the request is served
    with the default); the later stages keep their defaults, seeded by the request's seed."""
    from types import SimpleNamespace

    from omni_jax import Token2WavParams

    assert set(SAMPLING_VALUES) == set(convert.SAMPLING_FIELDS)
    stages = [
        SimpleNamespace(defaults=SamplingParams(), config=SimpleNamespace(name="thinker")),
        SimpleNamespace(defaults=SamplingParams(temperature=0.9), config=SimpleNamespace(name="talker")),
        SimpleNamespace(defaults=Token2WavParams(), config=SimpleNamespace(name="code2wav")),
    ]
    pipeline = SimpleNamespace(text_stage=0, stages=stages, speaks=True)
    request = CompletionRequest(model="m", prompt="hello", max_tokens=12, **SAMPLING_VALUES)
    served = convert.completion_request(pipeline, request)  # type: ignore[arg-type]  # what it reads
    text, talker, code2wav = served.sampling_params_list  # type: ignore[misc]
    assert {name: getattr(text, name) for name in SAMPLING_VALUES} == SAMPLING_VALUES
    assert text.max_tokens == 12
    assert talker == SamplingParams(temperature=0.9, seed=5) and code2wav == Token2WavParams(seed=5)


@pytest.mark.parametrize(
    "stored,want",
    [
        (np.array([0, 64, 128, 255], np.uint8), [-1.0, -0.5, 0.0, 127 / 128]),
        (np.array([2**30, -(2**31), 0], np.int32), [0.5, -1.0, 0.0]),
        (np.array([16384, -32768], np.int16), [0.5, -1.0]),
    ],
    ids=["8-bit", "32-bit", "16-bit"],
)
def test_integer_wavs_are_read_on_their_own_full_scale(stored: np.ndarray, want: list[float]) -> None:
    """Each integer WAV format maps its own full range to [-1, 1): 8-bit around 128, 32-bit by
    2**31 (a 32-bit export read on 16-bit's scale is samples up to 65536 the encoder never saw)."""
    buf = io.BytesIO()
    wavfile.write(buf, 16_000, stored)
    buf.seek(0)
    np.testing.assert_array_equal(read_audio_file(buf, 16_000), np.asarray(want, np.float32))


def test_a_clip_of_exactly_the_longest_length_is_taken() -> None:
    """``max_seconds`` is the longest a clip may last, itself included (30 s for the encoder)."""
    assert (
        read_audio_file(io.BytesIO(wav_bytes(np.zeros(16_000), 16_000)), 16_000, max_seconds=1).size == 16_000
    )
    with pytest.raises(ValueError, match=r"over the 1 s it may last"):
        read_audio_file(io.BytesIO(wav_bytes(np.zeros(16_001), 16_000)), 16_000, max_seconds=1)


def test_the_cpu_kernel_is_refused_on_an_accelerator() -> None:
    """Each kernel on the platform it compiles for, named at start-up (not in the first step's
    compiler error)."""
    from omni_jax.engine_args import check_backend_platform

    with pytest.raises(
        ValueError, match="attention_backend='cpu' is the CPU backend's kernel; this is a gpu"
    ):
        check_backend_platform("cpu", "gpu")
    with pytest.raises(ValueError, match="attention_backend='pallas' compiles its kernel for a GPU or TPU"):
        check_backend_platform("pallas", "cpu")
    check_backend_platform("cpu", "cpu")
    check_backend_platform("pallas", "gpu")


def test_tokenize_takes_a_prompt_or_messages_not_both() -> None:
    """``/tokenize`` with both would silently tokenize one of them."""
    from omni_jax.serve.protocol import TokenizeRequest

    both = '{"prompt": "x", "messages": [{"role": "user", "content": "y"}]}'
    for body in ("{}", both):
        with pytest.raises(ValidationError, match="give 'prompt' or 'messages', one of them"):
            TokenizeRequest.model_validate_json(body)
    TokenizeRequest.model_validate_json('{"prompt": "x"}')


@pytest.mark.parametrize("level", ["info", "debug"])
def test_the_libraries_bookkeeping_logs_only_when_debugging(level: str, monkeypatch) -> None:
    """At ``--log-level info`` the server's log holds its own lines, not JAX's backend probing
    or Orbax's (absl) checkpoint-handler lines; ``debug`` shows them."""
    from omni_jax.serve.cli import QUIET_LOGGERS, configure_logging

    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # basicConfig configures afresh
    saved = {name: logging.getLogger(name).level for name in (*QUIET_LOGGERS, "")}
    try:
        configure_logging(level)
        shown = logging.DEBUG if level == "debug" else logging.INFO
        assert logging.getLogger("omni_jax.serve").isEnabledFor(shown)
        for name in QUIET_LOGGERS:
            assert logging.getLogger(name).isEnabledFor(logging.INFO) == (level == "debug"), name
    finally:  # setLevel, which also clears the loggers' cached answers
        for name, saved_level in saved.items():
            logging.getLogger(name).setLevel(saved_level)


def test_the_server_s_processor_kwargs_are_a_request_s_unless_it_sets_its_own() -> None:
    """vLLM's ``--mm-processor-kwargs`` under a request's ``mm_processor_kwargs``, field by field
    (a request's explicit ``false`` overrides the server's ``true``); only fields set reach the
    prompt, so a text model's prompt holds none."""
    server = ProcessorKwargs(use_audio_in_video=True)
    assert convert.processor_kwargs(None, None) == {}
    assert convert.processor_kwargs(server, None) == {"use_audio_in_video": True}
    assert convert.processor_kwargs(server, ProcessorKwargs(fps=1)) == {
        "use_audio_in_video": True,
        "fps": 1.0,
    }
    asked = ProcessorKwargs.model_validate({"use_audio_in_video": False})
    assert convert.processor_kwargs(server, asked) == {"use_audio_in_video": False}
    assert convert.processor_kwargs(None, ProcessorKwargs()) == {}


def test_a_compressed_audio_file_goes_to_the_stage_as_its_bytes_its_header_checked(tmp_path) -> None:
    """Its samples are decoded by the stage, which stops at the longest clip it takes; what FFmpeg
    cannot open, or holds no audio stream, is refused here naming the field."""
    from media_samples import gradient_frames, tone, write_audio, write_video

    raw = write_audio(tmp_path / "a.mp3", tone(1, 16_000), 16_000, "mp3").read_bytes()
    where = "messages.0.content.1.input_audio.data"
    assert media.audio(where, base64.b64encode(raw).decode()) == raw
    with pytest.raises(
        FieldError, match=rf"^{re.escape(where)}: the audio file is not a media file FFmpeg can read"
    ):
        media.audio(where, base64.b64encode(b"\x00 not audio" * 20).decode())
    silent = write_video(tmp_path / "silent.mp4", gradient_frames(10, 32, 32), 25).read_bytes()
    with pytest.raises(FieldError, match=rf"^{re.escape(where)}: the audio file holds no audio stream$"):
        media.audio(where, base64.b64encode(silent).decode())
