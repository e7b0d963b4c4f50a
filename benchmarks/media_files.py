"""A video file's host cost: its frames sampled by :mod:`omni_jax.media_files` against transformers'
own ``load_video`` (PyAV backend), its track, and the processor's featurisation of both.

Why: a request with a video file is decoded and featurised on the host, on the admission
thread, before it reaches a device; this says how long that takes for a clip of a given size,
beside the reference's decode of the same frames (asserted equal). Builds an H.264 clip (or
takes ``--clip``), samples it at ``--fps``, and times the best of ``--repeats`` runs after an
untimed one (:func:`benchmarks.roofline.best_of`): frames alone (ours, transformers'), frames
with the track (ours), and ``OmniProcessor.process`` of the file with ``use_audio_in_video``
(decode, resize, patches, log-mel: what a request pays), with ``--model``'s processor (the
sizes a video is resized to are the released model's whatever the checkpoint:
``processor.VIDEO_SIZE``).

Usage: ``python -m benchmarks.media_files [--seconds 20] [--width 1280 --height 720] [--fps 2]``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.roofline import best_of
from omni_jax.cli_errors import plain_text
from omni_jax.media_files import decode_video_file

FRAME_RATE = 30
AUDIO_RATE = 44_100


def build_clip(path: Path, seconds: int, width: int, height: int) -> Path:
    """An H.264 clip of moving blocks at :data:`FRAME_RATE` with a stereo AAC tone track."""
    import av

    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (height // 8, width // 8, 3), dtype=np.uint8).repeat(8, 0).repeat(8, 1)
    with av.open(str(path), mode="w") as container:
        video = container.add_stream("libx264", rate=FRAME_RATE)
        video.width, video.height, video.pix_fmt = width, height, "yuv420p"
        video.options = {"preset": "veryfast", "crf": "23"}
        audio = container.add_stream("aac", rate=AUDIO_RATE)
        audio.layout = "stereo"
        for i in range(seconds * FRAME_RATE):
            frame = av.VideoFrame.from_ndarray(np.roll(blocks, 4 * i, axis=1), format="rgb24")
            for packet in video.encode(frame):
                container.mux(packet)
        for packet in video.encode(None):
            container.mux(packet)
        t = np.arange(seconds * AUDIO_RATE) / AUDIO_RATE
        tone = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
        sound = av.AudioFrame.from_ndarray(np.stack([tone, tone]), format="fltp", layout="stereo")
        sound.sample_rate, sound.pts = AUDIO_RATE, 0
        for packet in [*audio.encode(sound), *audio.encode(None)]:
            container.mux(packet)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.media_files", description=plain_text(__doc__.split("\n\n")[0])
    )
    parser.add_argument("--clip", type=Path, default=None, help="a video file (default: one built here)")
    parser.add_argument("--seconds", type=int, default=20)
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--height", type=int, default=720)
    parser.add_argument("--fps", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default="tiny", help="tiny, small, or a Qwen2.5-Omni checkpoint directory")
    parser.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "omni_jax" / "bench"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    from transformers.video_utils import load_video

    from benchmarks.models import resolve_model
    from omni_jax.models.qwen2_5_omni.processor import OmniProcessor

    with tempfile.TemporaryDirectory() as tmp:
        clip = args.clip or build_clip(Path(tmp) / "clip.mp4", args.seconds, args.width, args.height)
        ours = decode_video_file(clip, args.fps, max_frames=10**6, track=True)
        reference, _ = load_video(str(clip), fps=args.fps, backend="pyav")
        if not np.array_equal(ours.frames, reference):
            raise SystemExit("our frames differ from transformers' load_video's")
        processor = OmniProcessor.from_pretrained(
            resolve_model(args.model, Path(args.cache_dir), "qwen2_5_omni")
        )
        text = processor.tokenizer.encode("what happens")
        ids = [*text, processor.vision_bos_id, processor.video_id, *text]
        processed = processor.process(0, ids, {"video": str(clip)}, fps=args.fps, use_audio_in_video=True)
        times = {
            "frames, ours": best_of(
                lambda: decode_video_file(clip, args.fps, max_frames=10**6), args.repeats
            ),
            "frames, transformers' load_video": best_of(
                lambda: load_video(str(clip), fps=args.fps, backend="pyav"), args.repeats
            ),
            "frames and track, ours": best_of(
                lambda: decode_video_file(clip, args.fps, max_frames=10**6, track=True), args.repeats
            ),
            "OmniProcessor.process, use_audio_in_video": best_of(
                lambda: processor.process(
                    0, ids, {"video": str(clip)}, fps=args.fps, use_audio_in_video=True
                ),
                args.repeats,
            ),
        }
        size = clip.stat().st_size
    n, height, width, _ = ours.frames.shape
    print(
        f"clip: {size / 1e6:.2f} MB, {n} frames of {width}x{height} sampled at {args.fps:g} a second, "
        f"track {ours.track.size / ours.track_rate:.2f} s at {ours.track_rate} Hz; "
        f"{len(processed.input_ids)} prompt tokens, video grid {processed.video_grid_thw[0]}"
    )
    for name, seconds in times.items():
        print(f"{name:44} {seconds:7.3f} s")
    if args.json:
        args.json.write_text(
            json.dumps({"frames": n, "width": width, "height": height, "times_s": times}, indent=1)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
