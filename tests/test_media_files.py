"""Audio and video files FFmpeg reads (PyAV), as a user's files come: mp3, flac, ogg, m4a, mp4,
webm, mkv.

A video file's frames are the ones transformers' own ``load_video(path, fps=...)`` (its PyAV
backend) gives, where it can read the file; the prompt a file makes equals the one its decoded
frames and track make given as arrays (which the parity tests hold to transformers). What cannot
be read, or would decode past its limits, is refused from the header before it is decoded.
"""

from __future__ import annotations

import collections
import random
from functools import partial

import numpy as np
import pytest
from media_samples import gradient_frames, tone, write_audio, write_video

from omni_jax.audio_io import decode_audio, resample
from omni_jax.media_files import check_audio_file, decode_audio_file, decode_video_file
from omni_jax.models.qwen2_5_omni.processor import OmniProcessor

FRAMES = gradient_frames(50, 48, 64)
"""Two seconds at 25 frames a second."""


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> object:
    """An mp4 of :data:`FRAMES` at 25 fps with a stereo AAC track of 2 s at 22.05 kHz."""
    return write_video(tmp_path_factory.mktemp("media") / "clip.mp4", FRAMES, 25, tone(2, 22050, channels=2))


@pytest.mark.parametrize("fps", [2.0, 1.0, 12.5])
def test_video_frames_are_transformers_load_video_frames(clip, fps) -> None:
    from transformers.video_utils import load_video

    expected, _ = load_video(str(clip), fps=fps, backend="pyav")
    got = decode_video_file(clip, fps, max_frames=100)
    assert got.frames.dtype == np.uint8 and got.frames.shape == expected.shape
    np.testing.assert_array_equal(got.frames, expected)
    assert got.track is None
    assert decode_video_file(clip.read_bytes(), fps, max_frames=100).frames.shape == expected.shape


@pytest.mark.parametrize(("name", "codec"), [("clip.webm", "libvpx"), ("clip.mkv", "mpeg4")])
def test_containers_without_a_frame_count_are_sampled_from_their_duration(tmp_path, name, codec) -> None:
    """WebM and Matroska keep no frame count (transformers' ``load_video`` fails on them): the
    count comes from the duration, and each frame kept is the source frame of the index
    transformers' sampler picks for it (its rule changed in 5.18: either is followed)."""
    from transformers.video_utils import VideoMetadata, default_sample_indices_fn

    path = write_video(tmp_path / name, FRAMES, 25, codec=codec)
    got = decode_video_file(path, 2.0, max_frames=100).frames
    assert got.shape == (4, 48, 64, 3)
    indices = default_sample_indices_fn(VideoMetadata(total_num_frames=50, fps=25), num_frames=4)
    source = FRAMES[indices].astype(int)
    assert np.abs(got.astype(int) - source).max() <= 24  # lossy, but each frame is its own level
    assert np.abs(got.astype(int) - FRAMES[indices + 1].astype(int)).min(axis=(1, 2, 3)).min() > 24


def test_a_video_track_is_its_audio_stream_mixed_to_mono(clip) -> None:
    got = decode_video_file(clip, 2.0, max_frames=100, track=True)
    audio, rate = decode_audio_file(clip)
    assert got.track_rate == rate == 22050
    np.testing.assert_array_equal(got.track, audio)
    assert abs(audio.size - 2 * 22050) <= 2048  # an AAC encoder's priming and padding
    assert dominant_hz(audio, rate) == pytest.approx(440, abs=2)


def dominant_hz(audio: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(audio))
    return float(np.fft.rfftfreq(audio.size, 1 / rate)[spectrum.argmax()])


@pytest.mark.parametrize(
    ("name", "codec", "rate"),
    [
        ("a.mp3", "mp3", 44100),
        ("a.ogg", "libopus", 48000),
        ("a.m4a", "aac", 44100),
        ("a.flac", "flac", 44100),
    ],
)
def test_compressed_audio_files_decode_to_their_tone(tmp_path, name, codec, rate) -> None:
    source = tone(1.5, rate, channels=2)
    path = write_audio(tmp_path / name, source, rate, codec)
    audio, got_rate = decode_audio(path)
    assert got_rate == rate and audio.dtype == np.float32 and audio.ndim == 1
    assert abs(audio.size - source.shape[1]) <= 2048
    assert dominant_hz(audio, rate) == pytest.approx(440, abs=2)
    assert decode_audio(path.read_bytes())[0].shape == audio.shape


def test_flac_is_lossless(tmp_path) -> None:
    """FLAC keeps 16-bit samples exactly: decoded, each channel is its source as FFmpeg made it
    16-bit (``round(x * 32768)``, clipped), read back at 32768 full scale, and the mono mix their
    float32 mean (as a WAV's channels are mixed)."""
    source = tone(1.0, 16000, channels=2)
    path = write_audio(tmp_path / "a.flac", source, 16000, "flac")
    audio, _ = decode_audio(path)
    s16 = np.clip(np.round(source * np.float32(32768)), -32768, 32767)
    np.testing.assert_array_equal(audio, (s16 / np.float32(32768)).mean(axis=0, dtype=np.float32))


def test_what_ffmpeg_cannot_read_or_would_decode_past_its_limits_is_refused(tmp_path, clip) -> None:
    with pytest.raises(ValueError, match=r"^is not a media file FFmpeg can read \("):
        decode_audio(b"\x00\x01 not audio at all" * 10)
    mp3 = write_audio(tmp_path / "a.mp3", tone(3, 16000), 16000, "mp3")
    with pytest.raises(ValueError, match=r"^holds no video stream$"):
        decode_video_file(mp3, 2.0, max_frames=10)
    with pytest.raises(ValueError, match=r"^is 3\.\d+ s long .* over the 2 s it may last$"):
        decode_audio(mp3, max_seconds=2)
    silent = write_video(tmp_path / "silent.mp4", FRAMES, 25)
    with pytest.raises(ValueError, match=r"^holds no audio stream$"):
        decode_video_file(silent, 2.0, max_frames=10, track=True)
    with pytest.raises(
        ValueError, match=r"^lasts 2\.00 s: sampled at 2 frames a second that is 4 frames, over the 3"
    ):
        decode_video_file(clip, 2.0, max_frames=3)
    with pytest.raises(
        ValueError, match=r"^gives 4 frames of 64x48 pixels, 36864 bytes decoded, over the 36000"
    ):
        decode_video_file(clip, 2.0, max_frames=10, max_bytes=36000)
    with pytest.raises(ValueError, match=r"fewer than the 100 sampling it at 50 a second takes$"):
        decode_video_file(clip, 50.0, max_frames=1000)
    # MPEG-TS files join by their bytes: a stream whose frames grow past the size its header states
    # (what the bytes limit was checked against) is refused at the first such frame kept
    small = write_video(tmp_path / "small.ts", FRAMES[:4, :32, :32], 10, codec="mpeg2video")
    large = write_video(tmp_path / "large.ts", FRAMES[:40], 10, codec="mpeg2video")
    with pytest.raises(ValueError, match=r"^has a frame of 64x48 pixels where its header states 32x32$"):
        decode_video_file(small.read_bytes() + large.read_bytes(), 2.0, max_frames=100)


def with_unknown_codec(data: bytes, stream: int) -> bytes:
    """An mp4's bytes with its ``stream``-th stream's codec (the object type in its ``esds`` box,
    21 bytes in) set to one FFmpeg does not know, as a corrupt file can: PyAV then gives that
    stream no codec context."""
    at = [i for i in range(len(data)) if data[i : i + 4] == b"esds"][stream] + 21
    return data[:at] + b"\x01" + data[at + 1 :]


def test_a_stream_of_a_codec_ffmpeg_cannot_decode_is_refused(clip) -> None:
    """Not an ``AttributeError`` from PyAV (a server's 500): its rate and size come from a
    decoder it does not have."""
    data = clip.read_bytes()
    video, audio = with_unknown_codec(data, 0), with_unknown_codec(data, 1)
    with pytest.raises(ValueError, match=r"^has a video stream of a codec FFmpeg cannot decode$"):
        decode_video_file(video, 2.0, max_frames=100)
    for call in (
        lambda: check_audio_file(audio),
        lambda: decode_audio_file(audio),
        lambda: decode_audio(audio),
        lambda: decode_video_file(audio, 2.0, max_frames=100, track=True),
    ):
        with pytest.raises(ValueError, match=r"^has an audio stream of a codec FFmpeg cannot decode$"):
            call()
    assert decode_video_file(audio, 2.0, max_frames=100).frames.shape[0] == 4


@pytest.fixture(scope="module")
def processor(omni_dir) -> OmniProcessor:
    return OmniProcessor.from_pretrained(omni_dir)


def video_prompt(processor: OmniProcessor, videos: int = 1) -> list[int]:
    text = processor.tokenizer.encode("what happens")
    return [*text, *([processor.vision_bos_id, processor.video_id] * videos), *text]


@pytest.mark.parametrize("as_bytes", [False, True])
def test_a_video_file_prompt_equals_its_frames_and_track_given_as_arrays(processor, clip, as_bytes) -> None:
    """Sampled at the model's rate (Qwen2.5-Omni: 2 a second), its own track heard with it."""
    item = clip.read_bytes() if as_bytes else str(clip)
    ids = video_prompt(processor)
    got = processor.process(0, ids, {"video": item}, use_audio_in_video=True)
    from transformers.video_utils import load_video

    frames, _ = load_video(str(clip), fps=processor.default_fps, backend="pyav")
    track, rate = decode_audio(clip)
    expected = processor.process(0, ids, {"video": frames, "audio": [(track, rate)]}, use_audio_in_video=True)
    assert got.input_ids == expected.input_ids and got.video_grid_thw == expected.video_grid_thw
    for a, b in zip(
        got.video_patches + got.audio_features, expected.video_patches + expected.audio_features, strict=True
    ):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(
        expected.audio_features[0], processor.audio_features([resample(track, rate, 16000)])[0]
    )
    plain = processor.process(0, ids, {"video": item}, fps=1.0)
    assert plain.video_grid_thw == [(1, *got.video_grid_thw[0][1:])] and not plain.audio_features


def test_a_video_file_s_refusals_name_the_request_and_the_video(processor, clip, tmp_path) -> None:
    ids = video_prompt(processor, 2)
    silent = write_video(tmp_path / "silent.mp4", FRAMES, 25)
    with pytest.raises(
        ValueError, match=r"^request 3: video 1 \(file '.*silent\.mp4'\) holds no audio stream$"
    ):
        processor.process(3, ids, {"video": [str(clip), str(silent)]}, use_audio_in_video=True)
    with pytest.raises(
        ValueError, match=r"^request 3: video 1 \(bytes\) is not a media file FFmpeg can read"
    ):
        processor.process(3, ids, {"video": [str(clip), b"not a video" * 20]})
    with pytest.raises(ValueError, match=r"^request 3: video 0: file '.*gone\.mp4' does not exist$"):
        processor.process(3, ids, {"video": [str(tmp_path / "gone.mp4"), str(clip)]})
    with pytest.raises(
        ValueError, match=r"^request 3: use_audio_in_video without audio .* video 1 is frames"
    ):
        processor.process(3, ids, {"video": [str(clip), FRAMES[:4]]}, use_audio_in_video=True)
    most = processor.video_processor.temporal_patch_size * (40 // processor.video_processor.least_tokens(1))
    with pytest.raises(
        ValueError, match=rf"^request 3: video 0 .* that is 4 frames, over the {most} a prompt"
    ):
        processor.process(3, video_prompt(processor), {"video": str(clip)}, max_tokens=40)


def test_an_audio_file_of_any_kind_is_a_prompt_s_clip(processor, tmp_path) -> None:
    source = tone(1.5, 44100, channels=2)
    mp3 = write_audio(tmp_path / "a.mp3", source, 44100, "mp3")
    text = processor.tokenizer.encode("listen")
    ids = [*text, processor.audio_bos_id, processor.audio_id, *text]
    decoded, rate = decode_audio(mp3)
    expected = processor.process(0, ids, {"audio": [(decoded, rate)]})
    for item in (str(mp3), mp3.read_bytes()):
        got = processor.process(0, ids, {"audio": [item]})
        assert got.input_ids == expected.input_ids
        np.testing.assert_array_equal(got.audio_features[0], expected.audio_features[0])


def test_qwen3_omni_samples_a_video_file_at_its_own_rate(qwen3_omni_dir, clip) -> None:
    """Qwen3-Omni takes frames to be 1 a second apart when no ``fps`` is given: a file is sampled so."""
    from transformers.video_utils import load_video

    from omni_jax.models.qwen3_omni.processor import Qwen3OmniProcessor

    processor = Qwen3OmniProcessor.from_pretrained(qwen3_omni_dir)
    assert processor.default_fps == 1.0
    ids = video_prompt(processor)
    got = processor.process(0, ids, {"video": str(clip)}, use_audio_in_video=True)
    frames, _ = load_video(str(clip), fps=1.0, backend="pyav")
    assert len(frames) == 2
    track, rate = decode_audio(clip)
    expected = processor.process(0, ids, {"video": frames, "audio": [(track, rate)]}, use_audio_in_video=True)
    assert got.input_ids == expected.input_ids and got.video_grid_thw == expected.video_grid_thw
    np.testing.assert_array_equal(got.video_patches[0], expected.video_patches[0])
    np.testing.assert_array_equal(got.audio_features[0], expected.audio_features[0])


@pytest.mark.parametrize("fmt", ["mp3", "flac", "opus", "aac"])
def test_encoded_audio_decodes_to_its_samples(fmt) -> None:
    """A reply encoded as OpenAI's compressed formats: flac is its 16-bit samples exactly, the
    lossy ones the same tone (Opus decodes at 48 kHz)."""
    from omni_jax.audio_io import pcm16
    from omni_jax.media_files import encode_audio

    samples = tone(2, 24_000, hz=330)[0]
    audio, rate = decode_audio(encode_audio(samples, 24_000, fmt))
    if fmt == "flac":
        np.testing.assert_array_equal(audio, pcm16(samples) / np.float32(32768))
        return
    assert rate == (48_000 if fmt == "opus" else 24_000)
    assert abs(audio.size * 24_000 / rate - samples.size) <= 2048
    assert dominant_hz(audio, rate) == pytest.approx(330, abs=2)


def test_a_prompt_over_the_caller_s_limits_is_refused_before_its_files_are_decoded(processor) -> None:
    """``admit`` (the stage's per-prompt limits, ``limit_mm_per_prompt``) sees the items' counts,
    the videos' tracks among the audio, before a byte of a video file is decoded."""
    calls = []

    def admit(counts: dict[str, int], least: int) -> None:
        calls.append((counts, least))
        raise ValueError("request 0: over the limit")

    with pytest.raises(ValueError, match="^request 0: over the limit$"):
        processor.process(
            0, video_prompt(processor), {"video": b"not a video" * 10}, use_audio_in_video=True, admit=admit
        )
    assert calls == [({"audio": 1, "image": 0, "video": 1}, 0)]


def test_a_compressed_clip_past_the_longest_a_prompt_takes_is_refused_from_its_header(
    processor, tmp_path
) -> None:
    """A few kilobytes of mp3 can hold hours: bytes given to the stage (as the server gives it an
    mp3) are refused from the header's duration, over the extractor's window (the tiny
    checkpoint's 30 s), before any sample is decoded."""
    mp3 = write_audio(tmp_path / "long.mp3", tone(40, 8000), 8000, "mp3")
    text = processor.tokenizer.encode("listen")
    ids = [*text, processor.audio_bos_id, processor.audio_id, *text]
    with pytest.raises(
        ValueError, match=r"^request 2: audio \(file bytes\) is 40\.\d+ s long .* over the 30 s it may"
    ):
        processor.process(2, ids, {"audio": [mp3.read_bytes()]})


def test_a_file_naming_urls_to_read_makes_ffmpeg_fetch_nothing() -> None:
    """An HLS playlist names its segments' URLs, which FFmpeg opens: opened with
    :func:`open_options`, bytes fetch nothing (without them the same playlist reaches a listener
    on this machine: the check can fail)."""
    import http.server
    import io
    import socketserver
    import threading

    import av

    from omni_jax.media_files import open_options

    hits: list[str] = []

    class Listener(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            hits.append(self.path)
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    with socketserver.TCPServer(("127.0.0.1", 0), Listener) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}/segment.ts"
        playlist = f"#EXTM3U\n#EXT-X-TARGETDURATION:10\n#EXTINF:10,\n{url}\n#EXT-X-ENDLIST\n".encode()
        for options in (open_options(playlist), {}):
            with pytest.raises(av.error.FFmpegError):
                av.open(io.BytesIO(playlist), format="hls", options=options)
            hits.append("--")
        server.shutdown()
    assert hits == ["--", "/segment.ts", "--"]
    with pytest.raises(ValueError, match="^is not a media file FFmpeg can read"):
        decode_video_file(playlist, 2.0, 10)


def mutated(data: bytes, rng: random.Random) -> bytes:
    """``data`` cut short, with bytes overwritten or zeroed, or with a span taken out: what a
    corrupt upload or a client's forgery can look like."""
    out = bytearray(data)
    kind = rng.randrange(4)
    if kind == 0:
        return bytes(out[: rng.randrange(len(out))])
    if kind == 1:
        for _ in range(rng.randint(1, 60)):
            out[rng.randrange(len(out))] = rng.randrange(256)
    elif kind == 2:
        at = rng.randrange(len(out))
        out[at : at + 64] = bytes(len(out[at : at + 64]))
    else:
        start, end = sorted(rng.randrange(len(out)) for _ in range(2))
        del out[start:end]
    return bytes(out)


def test_mutated_files_are_refused_with_value_errors_alone(tmp_path) -> None:
    """Whatever FFmpeg and PyAV make of a damaged file, a reader answers with its result or a
    ``ValueError`` (the server's 400), never another exception (a 500): a seeded sample of
    damaged audio and video files of several containers (400 each)."""
    rng = random.Random(0)
    audio_files = [
        write_audio(tmp_path / "a.mp3", tone(1.0, 22050), 22050, "mp3"),
        write_audio(tmp_path / "a.flac", tone(1.0, 16000, channels=2), 16000, "flac"),
        write_audio(tmp_path / "a.ogg", tone(1.0, 48000), 48000, "libopus"),
    ]
    video_files = [
        write_video(tmp_path / "v.mp4", FRAMES[:12], 6, tone(2.0, 22050)),
        write_video(tmp_path / "v.webm", FRAMES[:12], 6, tone(2.0, 48000), 48000, "libvpx"),
        write_video(tmp_path / "v.mkv", FRAMES[:12], 6),
    ]
    others: collections.Counter[str] = collections.Counter()
    for path in audio_files + video_files:
        data = path.read_bytes()
        for _ in range(400):
            damaged = mutated(data, rng)
            calls = [partial(decode_audio, damaged, 60.0), partial(check_audio_file, damaged)]
            if path in video_files:
                calls.append(partial(decode_video_file, damaged, 2.0, 64, track=path.suffix != ".mkv"))
            for call in calls:
                try:
                    call()
                except ValueError:
                    pass
                except Exception as e:  # noqa: BLE001 - what the test counts
                    others[f"{path.name}: {type(e).__name__}: {e}"] += 1
    assert not others, others
