"""``omni-jax serve`` end to end: the server as a subprocess on 127.0.0.1, driven by the official
``openai`` client and by raw ``httpx`` (for SSE lines, error bodies and disconnects).

Every reply is held to ``OmniJaxPipeline.run`` in this process on the same prompt, with the
params ``omni_jax/serve/convert.py`` builds (the text stage: its defaults under the request's
fields; the later stages: their defaults, seeded by the request's ``seed``), compared token for
token and sample for sample (the tiny models' text is random-token gibberish).

Three servers, each started once per module:

* ``qwen``: the tiny Qwen2 checkpoint, built here with 16384 positions instead of 512 (it decodes
  over 1000 tokens/s on this CPU, so only a reply of thousands of tokens lasts long enough to be
  dropped mid-way or to hold the queue full; its programs are the same), with warm-up on
  (21 programs, about 20 s), an API key and a small body limit: chat and completions, stop
  strings, refusals, disconnects, ``/health`` while it warms up, ``/v1/models`` and ``/metrics``.
* ``queue``: the same checkpoint with ``--max-num-seqs 1 --max-queue 1 --no-warmup``: one request
  runs, one waits, the next is refused with 429 (only while both are in).
* ``omni``: the tiny Qwen2.5-Omni checkpoint with ``--no-warmup`` and a stage YAML with the
  architecture's defaults except the talker's ``max_tokens`` (32), code2wav's ``num_steps`` (2)
  and one solve per request of at most 32 codes (``max_batch: 1, max_codes: 32``); the reference
  pipeline reads the same YAML. Measured on this 2-core CPU: with the architecture's YAML the
  warm-up compiles 95 programs in 575 s (code2wav's 28 in 518 s); with this YAML still 61
  programs in 107 s, against about 55 s for the first spoken request here to compile what it
  needs, in the server and in the reference at once. The 32 concurrent streams go here, with
  mixed ``max_tokens`` and voices: 28 are text-only and 4 speak (two per voice), which keeps
  the test at about 5 s once the programs are compiled.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import httpx
import numpy as np
import openai
import pytest
from media_samples import gradient_frames, tone, write_audio, write_video
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families
from scipy.io import wavfile
from stage_yamls import Whole, edited_stages

import omni_jax
from omni_jax import OmniJaxPipeline, OmniRequestOutput, Token2WavParams
from omni_jax.audio_io import decode_audio as read_audio
from omni_jax.audio_io import pcm16, read_audio_file, resample, wav_bytes
from omni_jax.testing import OMNI_CODEC, build_tiny_qwen2

START_TIMEOUT_S = 400
API_KEY = "test-key-123"
MAX_BODY = 200_000
QWEN_SIZES = dict(max_num_seqs=4, max_model_len=16384, page_size=16)
OMNI_SIZES = dict(max_num_seqs=4, max_model_len=512, max_num_batched_tokens=128)
T = TypeVar("T")
U = TypeVar("U")
DOOMED_TOKENS = 16_000  # a reply of 22 s alone on this CPU (100 tokens take 0.15 s): dropped mid-way
LONG_TOKENS = 4000  # 3.6 s: the reply that holds the queue full


def size_args(sizes: dict[str, int]) -> list[str]:
    return [a for k, v in sizes.items() for a in (f"--{k.replace('_', '-')}", str(v))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m omni_jax.cli serve`` in a subprocess, its output in a log file.

    ``start`` returns at once; ``wait_healthy`` polls ``/health`` until 200, keeping what it
    saw before (``warming``: status and body of each answer, and one chat request's answer sent
    while it was 503) and ``/metrics`` then (``at_ready``), and fails with the server's log if
    it exits or takes too long."""

    def __init__(self, name: str, model: Path, log: Path, *args: str, key: str | None = None):
        self.name, self.key, self.log = name, key, log
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "omni_jax.cli", "serve", str(model), "--port", str(self.port)]
        self.cmd += ["--served-model-name", name, *args] + ([] if key is None else ["--api-key", key])
        self.warming: list[tuple[int, Any]] = []
        self.chat_while_warming: httpx.Response | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.at_ready: dict[Any, float] = {}  # /metrics when /health first said 200

    def start(self) -> Server:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        return self

    def log_tail(self, chars: int = 6000) -> str:
        text = self.log.read_text(errors="replace")
        return f"--- {self.name} server log ({self.log}) ---\n{text[-chars:]}"

    @property
    def headers(self) -> dict[str, str]:
        return {} if self.key is None else {"Authorization": f"Bearer {self.key}"}

    def wait_healthy(self) -> Server:
        deadline = time.monotonic() + START_TIMEOUT_S
        with httpx.Client(base_url=self.url, timeout=10) as http:
            while time.monotonic() < deadline:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    pytest.fail(f"the server exited with {self.proc.returncode}\n{self.log_tail()}")
                try:
                    r = http.get("/health")
                except httpx.TransportError:  # not listening yet
                    time.sleep(0.2)
                    continue
                self.warming.append((r.status_code, r.json()))
                if r.status_code == 200:
                    self.at_ready = self.metrics()
                    return self
                if self.chat_while_warming is None:
                    self.chat_while_warming = http.post(
                        "/v1/chat/completions", json=chat_body(self.name, "hello"), headers=self.headers
                    )
                time.sleep(0.2)
        pytest.fail(f"no 200 from /health within {START_TIMEOUT_S} s\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def client(self, **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=self.key or "none", max_retries=0, timeout=120, **kw
        )

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.url}/v1", api_key=self.key or "none", max_retries=0, timeout=300
        )

    def http(self, **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=kw.pop("timeout", 120), **kw)

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """``/metrics`` as ``{(sample name, sorted labels): value}``."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }


def alongside(request: Callable[[], T], reference: Callable[[], U]) -> tuple[T, U]:
    """``request()`` (work for the server) in a thread while ``reference()`` runs here: the two
    processes compile the programs they need at the same time, not one after the other."""
    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(request)
        ref = reference()
        return sent.result(), ref


@dataclasses.dataclass
class Served:
    """A running server and the reference pipeline it is held to."""

    server: Server
    ref: OmniJaxPipeline


def serve(request: pytest.FixtureRequest, server: Server, make_ref: Any) -> Iterator[Served]:
    """Start ``server`` and build the reference while it loads (``/health`` is polled from the
    start, so what it says while warming up is seen); stop it at teardown, showing its log when a
    test of the module failed."""
    failed = request.session.testsfailed
    server.start()
    pool = ThreadPoolExecutor(1)
    try:
        healthy = pool.submit(server.wait_healthy)
        ref = make_ref()
        yield Served(healthy.result(), ref)
    finally:
        server.stop()  # which also ends a wait_healthy still polling: the server has exited
        pool.shutdown()
        if request.session.testsfailed > failed:
            with request.config.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled():
                print(f"\n{server.log_tail(20_000)}")


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    """The tiny Qwen2 checkpoint of ``conftest.qwen2_dir`` with 16384 positions instead of 512,
    so that a reply can last long enough (seconds) to be dropped or to hold the queue full."""
    path = tmp_path_factory.mktemp("qwen2_16k") / "hf"
    return build_tiny_qwen2(path, seed=0, max_position_embeddings=16384)


WEB_APP = "https://app.example"
"""The one web origin the Qwen2 server lets browsers call it from (CORS)."""


@pytest.fixture(scope="module")
def qwen(request, qwen_dir, tmp_path_factory) -> Iterator[Served]:
    log = tmp_path_factory.mktemp("serve") / "qwen.log"
    args = ["--max-body-bytes", str(MAX_BODY), "--allowed-origins", WEB_APP, *size_args(QWEN_SIZES)]
    server = Server("tiny-qwen2", qwen_dir, log, *args, key=API_KEY)
    yield from serve(request, server, lambda: OmniJaxPipeline.from_pretrained(qwen_dir, **QWEN_SIZES))


@pytest.fixture(scope="module")
def queue(request, qwen_dir, qwen, tmp_path_factory) -> Iterator[Served]:
    log = tmp_path_factory.mktemp("serve") / "queue.log"
    sizes = dict(QWEN_SIZES, max_num_seqs=1)
    server = Server("queue", qwen_dir, log, "--max-queue", "1", "--no-warmup", *size_args(sizes))
    yield from serve(request, server, lambda: qwen.ref)


@pytest.fixture(scope="module")
def omni_yaml(tmp_path_factory) -> Path:
    """The architecture's stage YAML with short talker replies and small code2wav programs."""
    # Streamed replies decode in chunks of 6 codes, so most of the talker's replies take several.
    stream = {"chunk_codes": 6, "past_codes": 4, "future_codes": 2, "overlap_frames": 4}
    code2wav = {
        "default_sampling": {"num_steps": 2},
        "engine": Whole(max_batch=1, max_codes=32, stream=stream),
    }
    talker = {"default_sampling": {"max_tokens": 32}}
    path = tmp_path_factory.mktemp("omni_yaml") / "stages.yaml"
    return edited_stages(path, "qwen2_5_omni", talker=talker, code2wav=code2wav)


@pytest.fixture(scope="module")
def omni(request, omni_dir, omni_yaml, tmp_path_factory) -> Iterator[Served]:
    log = tmp_path_factory.mktemp("serve") / "omni.log"
    args = ["--stage-config", str(omni_yaml), "--no-warmup", *size_args(OMNI_SIZES)]
    server = Server("tiny-omni", omni_dir, log, *args)
    make = lambda: OmniJaxPipeline.from_pretrained(omni_dir, stage_config=omni_yaml, **OMNI_SIZES)  # noqa: E731
    yield from serve(request, server, make)


# -- requests and their references --------------------------------------------------------------


def chat_body(model: str, text: str, **fields: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}], **fields}


def stage_params(
    pipe: OmniJaxPipeline, seed: int | None = None, stream: bool = False, **text_fields: Any
) -> Any:
    """What convert.py builds: the text stage's defaults under the request's fields, the later
    stages' defaults with ``seed``; for a streamed reply (``stream``), its audio decoded in
    chunks as it comes."""
    params = [
        dataclasses.replace(
            pipe.stages[0].defaults, **text_fields, **({} if seed is None else {"seed": seed})
        )
    ]
    for stage in pipe.stages[1:]:
        p = dataclasses.replace(stage.defaults, **({} if seed is None else {"seed": seed}))
        params.append(dataclasses.replace(p, stream=True) if stream and isinstance(p, Token2WavParams) else p)
    return params[0] if len(params) == 1 else params


def run_one(pipe: OmniJaxPipeline, prompt: Any, params: Any) -> OmniRequestOutput:
    (out,) = pipe.run(prompt, params, progress=False)
    assert out.finish_reason in ("stop", "length"), out.error
    return out


def chat_ref(
    pipe: OmniJaxPipeline, messages: list[dict[str, Any]], seed: int | None = None, **fields: Any
) -> Any:
    """run() on ``pipe.chat_prompt(messages)`` (text only) with the request's fields."""
    prompt = pipe.chat_prompt(messages)
    if len(pipe.stages) > 1:
        prompt["modalities"] = ["text"]
    return run_one(pipe, prompt, stage_params(pipe, seed, **fields))


def sse_events(lines: Iterator[str]) -> Iterator[Any]:
    """The JSON of each ``data:`` line of an SSE stream, up to ``[DONE]``, which must end it."""
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: ") :]
        if data == "[DONE]":
            return
        yield json.loads(data)
    raise AssertionError("the stream ended without data: [DONE]")


def check_error(r: httpx.Response, status: int, kind: str, *says: str) -> dict[str, Any]:
    """OpenAI's error JSON, with ``status`` and a message naming the problem."""
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert body.keys() == {"error"} and body["error"].keys() == {"message", "type", "param", "code"}, body
    error = body["error"]
    assert error["type"] == kind and error["code"] == status, error
    for part in says:
        assert part in error["message"], error
    return error


# -- the Qwen2 server: warm-up, models, metrics ---------------------------------------------------


def test_health_is_503_while_warming_up_then_200(qwen) -> None:
    server = qwen.server
    statuses = [status for status, _ in server.warming]
    assert statuses[-1] == 200 and server.warming[-1][1] == {"status": "ok"}
    assert statuses[0] == 503 and set(statuses[:-1]) == {503}, statuses
    assert all(body == {"status": "warming up"} for _, body in server.warming[:-1])
    r = server.chat_while_warming
    assert r is not None
    check_error(r, 503, "service_unavailable", "warming up")
    assert r.headers["retry-after"] == "10"
    log = server.log.read_text()
    listening = f"listening on http://127.0.0.1:{server.port}"
    assert "warm-up compiled" in log and log.index(listening) < log.index("warm-up compiled")
    # said when it starts, and its bar counts the programs as they compile (not only at the end)
    assert log.index("warming up ['llm']: compiling every program") < log.index("warm-up compiled")
    assert "llm: 1 XLA programs compiled" in log or "llm: 0 XLA programs compiled, 1 loaded" in log


def test_models_lists_the_served_name(qwen) -> None:
    """With vLLM's ``root`` (the checkpoint served) and ``max_model_len`` (the context clients
    size ``max_tokens`` by)."""
    (model,) = qwen.server.client().models.list().data
    assert (model.id, model.object, model.owned_by) == ("tiny-qwen2", "model", "omni-jax")
    assert model.max_model_len == QWEN_SIZES["max_model_len"] == qwen.ref.stages[0].max_model_len
    assert model.root == str(qwen.ref.model_dir)
    assert qwen.server.client().models.retrieve("tiny-qwen2") == model  # OpenAI's one-model card
    with pytest.raises(openai.NotFoundError, match="'gpt-4o' does not exist here") as refused:
        qwen.server.client().models.retrieve("gpt-4o")
    assert refused.value.param == "model"


# -- chat and completions on Qwen2, greedy ----------------------------------------------------------

MESSAGES = [
    [{"role": "user", "content": "hello world the model"}],
    [
        {"role": "developer", "content": "you are a cat"},  # OpenAI's new name for "system"
        {"role": "user", "content": "what is the time"},
        {"role": "assistant", "content": "seven"},
        {"role": "user", "content": [{"type": "text", "text": "and "}, {"type": "text", "text": "now?"}]},
    ],
    [  # an assistant turn may say nothing (OpenAI's null content)
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "still there?"},
    ],
]


def as_run_reads_them(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """MESSAGES as chat_prompt() takes them: "developer" is "system", text parts are joined, no
    content is empty."""
    return [
        {
            "role": "system" if m["role"] == "developer" else m["role"],
            "content": m["content"]
            if isinstance(m["content"], str)
            else "".join(p["text"] for p in m["content"] or ()),
        }
        for m in messages
    ]


@pytest.mark.parametrize("messages", MESSAGES, ids=["one turn", "developer and parts", "silent assistant"])
def test_chat_greedy_equals_run(qwen, messages) -> None:
    flat = as_run_reads_them(messages)
    assert all(m["role"] != "developer" and isinstance(m["content"], str) for m in flat)
    ref = chat_ref(qwen.ref, flat, temperature=0.0, max_tokens=24)
    client = qwen.server.client()
    r = client.chat.completions.create(model="tiny-qwen2", messages=messages, temperature=0, max_tokens=24)
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.audio is None
    assert choice.message.content == ref.text and choice.finish_reason == ref.finish_reason
    assert r.object == "chat.completion" and r.model == "tiny-qwen2" and r.id.startswith("chatcmpl-")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (
        len(ref.prompt_token_ids),
        len(ref.token_ids),
    )
    assert r.usage.total_tokens == len(ref.prompt_token_ids) + len(ref.token_ids)

    chunks = list(
        client.chat.completions.create(
            model="tiny-qwen2",
            messages=messages,
            temperature=0,
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *deltas, usage = chunks
    assert len({c.id for c in chunks}) == 1 and all(c.object == "chat.completion.chunk" for c in chunks)
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in deltas) == ref.text
    assert len(deltas) > 3  # the text came in pieces, not whole at the end
    assert [c.choices[0].finish_reason for c in deltas] == [None] * (len(deltas) - 1) + [ref.finish_reason]
    assert usage.choices == [] and usage.usage.completion_tokens == len(ref.token_ids)
    assert usage.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_chat_sampling_fields_reach_the_text_stage(qwen) -> None:
    """A seeded, sampled request (several fields over the defaults) says what run() says with them."""
    fields = dict(temperature=1.3, top_p=0.9, top_k=20, max_tokens=16, seed=7, repetition_penalty=1.1)
    ref = chat_ref(qwen.ref, MESSAGES[0], ignore_eos=True, **fields)
    greedy = chat_ref(qwen.ref, MESSAGES[0], temperature=0.0, max_tokens=16, ignore_eos=True)
    assert ref.token_ids != greedy.token_ids  # the fields matter
    openai_fields = {k: v for k, v in fields.items() if k not in ("top_k", "repetition_penalty")}
    vllm_fields = dict(ignore_eos=True, top_k=20, repetition_penalty=1.1)  # served extensions
    r = qwen.server.client().chat.completions.create(
        model="tiny-qwen2", messages=MESSAGES[0], extra_body=vllm_fields, **openai_fields
    )
    assert r.choices[0].message.content == ref.text and r.usage.completion_tokens == 16
    # max_completion_tokens (OpenAI's newer name) over max_tokens
    short = chat_ref(qwen.ref, MESSAGES[0], temperature=0.0, max_tokens=5, ignore_eos=True)
    r = qwen.server.client().chat.completions.create(
        model="tiny-qwen2",
        messages=MESSAGES[0],
        temperature=0,
        max_tokens=16,
        max_completion_tokens=5,
        extra_body={"ignore_eos": True},
    )
    assert (r.choices[0].message.content, r.usage.completion_tokens) == (short.text, 5)


def test_stop_strings_cut_the_reply(qwen) -> None:
    ref = chat_ref(qwen.ref, MESSAGES[0], temperature=0.0, max_tokens=40, ignore_eos=True)
    text = ref.text
    assert len(text) > 12
    stops = [text[9:12], text[5:7] + "\x00never"]  # the first ends the reply, the second never comes
    want = text[: text.find(stops[0])]
    fields = dict(temperature=0, max_tokens=40, stop=stops, extra_body={"ignore_eos": True})
    client = qwen.server.client()
    r = client.chat.completions.create(model="tiny-qwen2", messages=MESSAGES[0], **fields)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (want, "stop")
    assert 0 < r.usage.completion_tokens < 40  # the request ended at the stop string
    chunks = list(
        client.chat.completions.create(model="tiny-qwen2", messages=MESSAGES[0], stream=True, **fields)
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


COMPLETION_PROMPTS = {"text": "the model stream request", "token ids": [5, 17, 99, 3, 250, 42, 8]}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("kind", COMPLETION_PROMPTS)
def test_completions_equal_run(qwen, kind, stream) -> None:
    prompt = COMPLETION_PROMPTS[kind]
    ref_prompt = {"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": prompt}
    ref = run_one(qwen.ref, ref_prompt, stage_params(qwen.ref, temperature=0.0, max_tokens=20))
    client = qwen.server.client()
    fields: dict[str, Any] = dict(model="tiny-qwen2", prompt=prompt, temperature=0, max_tokens=20)
    if not stream:
        r = client.completions.create(**fields)
        assert r.object == "text_completion" and r.id.startswith("cmpl-")
        assert (r.choices[0].text, r.choices[0].finish_reason) == (ref.text, ref.finish_reason)
        usage = r.usage
    else:
        *chunks, last = client.completions.create(
            stream=True, stream_options={"include_usage": True}, **fields
        )
        assert "".join(c.choices[0].text for c in chunks) == ref.text and len(chunks) > 3
        assert chunks[-1].choices[0].finish_reason == ref.finish_reason and last.choices == []
        usage = last.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ref.prompt_token_ids), len(ref.token_ids))


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_continuous_usage_stats_count_the_tokens_so_far_in_every_chunk(qwen, endpoint) -> None:
    """vLLM's ``stream_options.continuous_usage_stats``: every chunk carries the request's
    usage so far, counting up to the final usage chunk's."""
    fields: dict[str, Any] = dict(
        model="tiny-qwen2",
        temperature=0,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    client = qwen.server.client()
    if endpoint == "chat":
        chunks = list(client.chat.completions.create(messages=MESSAGES[0], **fields))
    else:
        chunks = list(client.completions.create(prompt="hello world", **fields))
    *pieces, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 12
    counts = [c.usage.completion_tokens for c in pieces]
    assert counts == sorted(counts) and counts[-1] == 12 and len(set(counts)) > 3
    assert endpoint == "completions" or counts[0] == 0  # chat's role chunk comes before any token
    assert {c.usage.prompt_tokens for c in pieces} == {last.usage.prompt_tokens}
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in pieces)
    del fields["stream_options"]["continuous_usage_stats"]
    plain = list(client.completions.create(prompt="hello world", **fields))
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage.completion_tokens == 12


def test_openais_bookkeeping_fields_and_vllms_include_stop_str_are_taken(qwen) -> None:
    """``user``, ``metadata``, ``service_tier`` and ``store: false`` change nothing; vLLM's
    ``include_stop_str_in_output`` keeps the stop string in the text, as ``run()`` does."""
    ref = chat_ref(qwen.ref, MESSAGES[0], temperature=0.0, max_tokens=12, ignore_eos=True)
    stop = ref.text[3:5]
    client = qwen.server.client()
    fields: dict[str, Any] = dict(model="tiny-qwen2", messages=MESSAGES[0], temperature=0, max_tokens=12)
    r = client.chat.completions.create(
        **fields,
        user="u-1",
        metadata={"team": "a"},
        service_tier="auto",
        store=False,
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].message.content == ref.text
    for keep in (False, True):
        want = chat_ref(
            qwen.ref,
            MESSAGES[0],
            temperature=0.0,
            max_tokens=12,
            ignore_eos=True,
            stop=[stop],
            include_stop_str_in_output=keep,
        )
        assert want.text.endswith(stop) == keep
        extra = {"ignore_eos": True, "include_stop_str_in_output": keep}
        got = client.chat.completions.create(**fields, stop=stop, extra_body=extra)
        assert (got.choices[0].message.content, got.choices[0].finish_reason) == (want.text, "stop")


def test_health_answers_head_and_vllms_ping_and_version(qwen) -> None:
    with httpx.Client(base_url=qwen.server.url, timeout=60) as http:  # no key: not /v1 routes
        assert http.head("/health").status_code == 200
        assert http.get("/ping").json() == http.post("/ping").json() == {"status": "ok"}
        assert http.get("/version").json() == {"version": omni_jax.__version__}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_n_choices_are_runs_seeded_apart(qwen, stream) -> None:
    """``n`` replies to one chat prompt: choice ``j`` is run()'s with the seed plus ``j`` (they
    differ, and the request repeats), the prompt's tokens counted once in the usage; streamed,
    each chunk names its choice, and each choice has its role, text and finish reason."""
    messages = MESSAGES[0]
    prompt = qwen.ref.chat_prompt(messages)
    refs = [
        run_one(
            qwen.ref,
            prompt,
            stage_params(qwen.ref, temperature=1.0, max_tokens=8, ignore_eos=True, seed=5 + j),
        )
        for j in range(3)
    ]
    assert len({r.text for r in refs}) == 3
    client = qwen.server.client()
    body: dict[str, Any] = dict(
        model="tiny-qwen2", messages=messages, n=3, seed=5, temperature=1.0, max_tokens=8
    )
    if stream:
        chunks = list(
            client.chat.completions.create(
                stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}, **body
            )
        )
        *pieces, last = chunks
        texts = [
            "".join(c.choices[0].delta.content or "" for c in pieces if c.choices[0].index == j)
            for j in range(3)
        ]
        roles = [c.choices[0].index for c in pieces if c.choices[0].delta.role == "assistant"]
        ends = {c.choices[0].index: c.choices[0].finish_reason for c in pieces if c.choices[0].finish_reason}
        assert sorted(roles) == [0, 1, 2] and ends == {0: "length", 1: "length", 2: "length"}
        usage = last.usage
    else:
        r = client.chat.completions.create(extra_body={"ignore_eos": True}, **body)
        assert [c.index for c in r.choices] == [0, 1, 2]
        texts = [c.message.content for c in r.choices]
        usage = r.usage
    assert texts == [ref.text for ref in refs]
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(refs[0].prompt_token_ids), 3 * 8)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_completion_of_several_prompts_has_their_choices_in_order(qwen, stream) -> None:
    """A list of prompts, ``n=2`` each: OpenAI's choices, each prompt's ``n`` together, each
    run()'s; every prompt's tokens counted once."""
    prompts = [COMPLETION_PROMPTS["token ids"], [9, 8, 7]]
    refs = [
        run_one(
            qwen.ref,
            {"prompt_token_ids": p},
            stage_params(qwen.ref, seed=3 + j, temperature=1.0, max_tokens=6, ignore_eos=True),
        )
        for p in prompts
        for j in range(2)
    ]
    client = qwen.server.client()
    body: dict[str, Any] = dict(
        model="tiny-qwen2",
        prompt=prompts,
        n=2,
        seed=3,
        temperature=1.0,
        max_tokens=6,
        extra_body={"ignore_eos": True},
    )
    if stream:
        *pieces, last = client.completions.create(stream=True, stream_options={"include_usage": True}, **body)
        texts = ["".join(c.choices[0].text for c in pieces if c.choices[0].index == i) for i in range(4)]
        usage = last.usage
    else:
        r = client.completions.create(**body)
        assert [c.index for c in r.choices] == [0, 1, 2, 3]
        texts, usage = [c.text for c in r.choices], r.usage
    assert texts == [ref.text for ref in refs]
    assert usage.prompt_tokens == len(prompts[0]) + len(prompts[1]) and usage.completion_tokens == 4 * 6


def test_one_prompt_refused_refuses_the_whole_request(qwen, good_ref) -> None:
    """A completion of two prompts, the second too long: a 400 naming it by its place in the
    list (``prompt.1``, in ``param`` and in the message), and the first, which the stage
    admitted, is aborted, not left running (its KV pages free again)."""
    with qwen.server.http() as http:
        body = {
            "model": "tiny-qwen2",
            "prompt": [[5, 6, 7], [7] * 17_000],
            "max_tokens": 30,
            "ignore_eos": True,
        }
        error = check_error(
            http.post("/v1/completions", json=body), 400, "invalid_request_error", "17000 tokens"
        )
        assert error["param"] == "prompt.1"
        assert error["message"].startswith("prompt.1: prompt has 17000 tokens")
        check_good_request(http, good_ref)
    metrics = qwen.server.metrics()
    assert metrics[("omni_jax:num_requests", ())] == 0
    assert (
        metrics[("omni_jax:kv_pages_free", (("stage", "llm"),))]
        == metrics[("omni_jax:kv_pages_capacity", (("stage", "llm"),))]
    )


def test_browsers_may_call_from_the_allowed_origins_alone(qwen, queue) -> None:
    """``--allowed-origins``: a page of that origin passes the preflight and reads the replies
    (the key still required); another origin's preflight is refused, and a server started
    without the option answers no preflight at all (no CORS headers)."""
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    with httpx.Client(base_url=qwen.server.url, timeout=60) as http:
        r = http.options("/v1/chat/completions", headers={"Origin": WEB_APP, **preflight})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == WEB_APP
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        r = http.options("/v1/chat/completions", headers={"Origin": "https://evil.example", **preflight})
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
        r = http.get("/v1/models", headers={"Origin": WEB_APP})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == WEB_APP
    with queue.server.http() as http:
        r = http.options("/v1/chat/completions", headers={"Origin": WEB_APP, **preflight})
        assert r.status_code == 405 and "access-control-allow-origin" not in r.headers


def test_vllms_tokenize_and_detokenize(qwen) -> None:
    """``/tokenize``: a prompt's ids (or chat messages', written with the chat template), their
    count and the context, each token's text when asked; ``/detokenize`` reads them back. The
    key is required, and a bad body or id is a 400 naming it."""
    tokenizer = qwen.ref.tokenizer
    chat = qwen.ref.chat_prompt(MESSAGES[0])["prompt"]
    with qwen.server.http() as http:
        r = http.post("/tokenize", json={"prompt": "hello world", "return_token_strs": True}).json()
        want = tokenizer("hello world")["input_ids"]
        assert (r["tokens"], r["count"], r["max_model_len"]) == (want, len(want), 16384)
        assert r["token_strs"] == [tokenizer.decode([t]) for t in want]
        r = http.post("/tokenize", json={"model": "tiny-qwen2", "messages": MESSAGES[0]}).json()
        assert r["tokens"] == tokenizer(chat)["input_ids"] and r["token_strs"] is None
        assert http.post("/detokenize", json={"tokens": r["tokens"]}).json() == {
            "prompt": tokenizer.decode(r["tokens"])
        }
        error = check_error(
            http.post("/detokenize", json={"tokens": [5, 10**6]}),
            400,
            "invalid_request_error",
            "token id 1000000 is outside",
        )
        assert error["param"] == "tokens"
        check_error(
            http.post("/tokenize", json={}), 400, "invalid_request_error", "give 'prompt' or 'messages'"
        )
        check_error(
            http.post("/tokenize", json={"prompt": "x", "model": "gpt-4o"}),
            404,
            "not_found_error",
            "does not exist",
        )
    with httpx.Client(base_url=qwen.server.url, timeout=60) as http:
        check_error(http.post("/tokenize", json={"prompt": "x"}), 401, "authentication_error", "API key")


def test_max_tokens_fill_the_context_to_its_end(qwen) -> None:
    """A ``max_tokens`` that fills the context exactly is served (one more is refused: REFUSALS);
    without one, the stage's default (64 tokens) stops at the context's end instead of being
    refused."""
    client = qwen.server.client()
    prompt = [7] * 16_380
    for given in ({"max_tokens": 4}, {}):
        r = client.completions.create(
            model="tiny-qwen2", prompt=prompt, temperature=0, extra_body={"ignore_eos": True, **given}
        )
        assert (r.choices[0].finish_reason, r.usage.prompt_tokens, r.usage.completion_tokens) == (
            "length",
            16_380,
            4,
        ), given


TOP = 3


def openai_token(tokenizer: Any, token_id: int) -> str:
    """How OpenAI writes a token: its text decoded alone, or, where it holds part of a
    character, ``bytes:`` and its bytes escaped (from GPT-2's byte alphabet, Qwen's)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    text = tokenizer.decode([token_id])
    if "\ufffd" not in text:
        return text
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    raw = bytes(byte_of[c] for c in tokenizer.convert_ids_to_tokens(token_id))
    return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def most_likely(ref: OmniRequestOutput, tokenizer: Any) -> list[tuple[str, float, list[tuple[str, float]]]]:
    """Per reply token of ``run()`` with ``logprobs=TOP``: its text (:func:`openai_token`), its
    log-probability and the ``TOP`` most likely tokens', the most likely first."""
    assert ref.logprobs is not None
    want = []
    for token, entry in zip(ref.token_ids, ref.logprobs, strict=True):
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:TOP]
        want.append(
            (
                openai_token(tokenizer, token),
                entry[token],
                [(openai_token(tokenizer, t), v) for t, v in top],
            )
        )
    return want


def spelled(token: str, raw: list[int]) -> bool:
    """Whether a logprobs entry's token is its bytes: their text, or ``bytes:`` and them
    escaped where they are not whole characters."""
    try:
        return token == bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
        return token == "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def check_chat_logprobs(content: list[Any], want: list[tuple[str, float, list[tuple[str, float]]]]) -> None:
    """Equal to ``run()``'s: one request alone, the same steps in the server as in the reference."""
    assert len(content) == len(want)
    for got, (token, logprob, top) in zip(content, want, strict=True):
        assert (got.token, got.logprob) == (token, logprob)
        assert spelled(got.token, got.bytes)
        assert [(t.token, t.logprob) for t in got.top_logprobs] == top
        assert all(spelled(t.token, t.bytes) for t in got.top_logprobs)


def test_chat_logprobs_are_runs(qwen) -> None:
    """``logprobs`` and ``top_logprobs``: each reply token's log-probability and the most likely
    tokens', as ``run()`` gives them with ``SamplingParams(logprobs=...)``, whole and streamed
    (each chunk with its own tokens'), read by the openai client."""
    ref = chat_ref(qwen.ref, MESSAGES[0], temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=TOP)
    want = most_likely(ref, qwen.ref.tokenizer)
    client = qwen.server.client()
    fields: dict[str, Any] = dict(
        model="tiny-qwen2",
        messages=MESSAGES[0],
        temperature=0,
        max_tokens=12,
        logprobs=True,
        top_logprobs=TOP,
        extra_body={"ignore_eos": True},
    )
    r = client.chat.completions.create(**fields)
    assert r.choices[0].message.content == ref.text
    check_chat_logprobs(r.choices[0].logprobs.content, want)
    # A character split across tokens reads as its bytes token by token; the bytes rebuild it.
    joined = b"".join(bytes(e.bytes) for e in r.choices[0].logprobs.content)
    assert joined.decode("utf-8", errors="replace") == qwen.ref.tokenizer.decode(ref.token_ids)
    assert any(e.token.startswith("bytes:\\x") for e in r.choices[0].logprobs.content)  # this reply has one
    chunks = list(client.chat.completions.create(stream=True, **fields))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    streamed = [e for c in chunks if c.choices[0].logprobs is not None for e in c.choices[0].logprobs.content]
    check_chat_logprobs(streamed, want)
    assert sum(c.choices[0].logprobs is not None for c in chunks) > 3  # in pieces, as they came
    alone = client.chat.completions.create(**{**fields, "top_logprobs": None})
    assert [e.top_logprobs for e in alone.choices[0].logprobs.content] == [[]] * 12
    assert [e.token for e in alone.choices[0].logprobs.content] == [t for t, _, _ in want]
    plain = client.chat.completions.create(**{**fields, "logprobs": None, "top_logprobs": None})
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == ref.text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completion_logprobs_are_runs(qwen, stream) -> None:
    """A completion's ``logprobs: N``: OpenAI's legacy lists. ``top_logprobs`` maps texts to
    log-probabilities, the sampled token's first and then the ``N`` most likely (as vLLM's), a
    piece of a character written as its bytes (``bytes:\\x..``), so that
    the pieces at a step keep a key each (vLLM reads them all U+FFFD, one key). ``text_offset``
    is where each whole token's text stands in the completion's (a stream's chunks continue
    the count)."""
    prompt = COMPLETION_PROMPTS["token ids"]
    params = stage_params(qwen.ref, temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=TOP)
    ref = run_one(qwen.ref, {"prompt_token_ids": prompt}, params)
    want = most_likely(ref, qwen.ref.tokenizer)
    fields: dict[str, Any] = dict(
        model="tiny-qwen2",
        prompt=prompt,
        temperature=0,
        max_tokens=10,
        logprobs=TOP,
        extra_body={"ignore_eos": True},
    )
    client = qwen.server.client()
    if stream:
        chunks = [c.choices[0].logprobs for c in client.completions.create(stream=True, **fields)]
        lists = [c for c in chunks if c is not None]
        assert len(lists) > 3
    else:
        lists = [client.completions.create(**fields).choices[0].logprobs]
    tokens = [t for c in lists for t in c.tokens]
    assert tokens == [t for t, _, _ in want]
    assert [v for c in lists for v in c.token_logprobs] == [v for _, v, _ in want]
    tops = [top for c in lists for top in c.top_logprobs]
    sampled_first = [dict([(token, logprob), *top]) for token, logprob, top in want]
    assert [list(top.items()) for top in tops] == [list(top.items()) for top in sampled_first]
    assert sum(t.startswith("bytes:") for t in tokens) > 0  # this reply has pieces of characters
    assert all(len(top) == TOP for top in tops)  # greedy: the sampled token is the most likely
    offsets = [o for c in lists for o in c.text_offset]
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert all(
        ref.text[o : o + len(t)] == t
        for t, o in zip(tokens, offsets, strict=True)
        if not t.startswith("bytes:")
    )


def test_a_raw_stream_is_server_sent_events(qwen) -> None:
    """What a client without the SDK reads: ``data: <json>`` lines, blank lines, ``data: [DONE]``."""
    ref = chat_ref(qwen.ref, MESSAGES[0], temperature=0.0, max_tokens=8)
    with qwen.server.http() as http:
        body = chat_body("tiny-qwen2", MESSAGES[0][0]["content"], temperature=0, max_tokens=8, stream=True)
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            lines = list(r.iter_lines())
    assert lines[-2:] == ["data: [DONE]", ""] and all(line == "" for line in lines[1::2])
    events = list(sse_events(iter(lines)))
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == ref.text
    assert "usage" not in events[-1]  # not asked for


# -- refusals --------------------------------------------------------------------------------------

PNG = io.BytesIO()
Image.fromarray(np.random.default_rng(0).integers(0, 256, (28, 28, 3), dtype=np.uint8)).save(
    PNG, format="PNG"
)
PNG_URL = f"data:image/png;base64,{base64.b64encode(PNG.getvalue()).decode()}"


def image_message(url: str) -> list[dict[str, Any]]:
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what is it"}]
    return [{"role": "user", "content": parts}]


GOOD = chat_body("tiny-qwen2", "hello", temperature=0, max_tokens=3)
REFUSALS = {
    "malformed JSON": (b'{"model": "tiny-qwen2", "messages": [', 400, "the body is not a JSON object", None),
    "wrong type": (
        {**GOOD, "max_tokens": "many"},
        400,
        "max_tokens: Input should be a valid integer",
        "max_tokens",
    ),
    "out of range": (
        {**GOOD, "temperature": -1},
        400,
        "temperature: Input should be greater than",
        "temperature",
    ),
    "an integer as a bool": (
        {**GOOD, "max_tokens": True},
        400,
        "max_tokens: Input should be a valid integer",
        "max_tokens",
    ),
    "a number as a string": (
        {**GOOD, "temperature": "0.5"},
        400,
        "temperature: Input should be a valid number",
        "temperature",
    ),
    "a bool as a string": (
        {**GOOD, "stream": "yes"},
        400,
        "stream: Input should be a valid boolean",
        "stream",
    ),
    "unknown field": ({**GOOD, "best_of": 2}, 400, "unsupported field 'best_of'", "best_of"),
    "a role not served": (
        {**GOOD, "messages": [{"role": "tool", "content": "4", "tool_call_id": "call_1"}]},
        400,
        "messages.0.role: Input should be 'system', 'developer', 'user' or 'assistant'",
        "messages.0.role",
    ),
    "a user turn without content": (
        {**GOOD, "messages": [{"role": "user", "content": None}]},
        400,
        "messages.0: a user message needs content",
        "messages.0",
    ),
    "stream_options without stream": (
        {**GOOD, "stream_options": {"include_usage": True}},
        400,
        "stream_options: only allowed with stream: true",
        "stream_options",
    ),
    "seed past 64 bits": (
        {**GOOD, "seed": 2**64},
        400,
        "seed=18446744073709551616 must be an integer from -2**63 to 2**64 - 1",
        "seed",
    ),
    "min_tokens over max_tokens": (
        {**GOOD, "min_tokens": 5},
        400,
        "min_tokens=5 must not exceed max_tokens=3",
        "min_tokens",
    ),
    "unserved OpenAI field": ({**GOOD, "tools": []}, 400, "unsupported field 'tools'", "tools"),
    "store": ({**GOOD, "store": True}, 400, "store: Input should be False", "store"),
    "store as 0": ({**GOOD, "store": 0}, 400, "store: Input should be a valid boolean", "store"),
    "n past OpenAI's bound": ({**GOOD, "n": 129}, 400, "n: Input should be less than or equal to 128", "n"),
    "empty stop": ({**GOOD, "stop": ["x", ""]}, 400, "stop: stop strings must not be empty", "stop"),
    "stop strings past their bound": (
        {**GOOD, "stop": ["x" * 1000] * 66},
        400,
        "stop strings hold 66000 characters together, at most 65536",
        "stop",
    ),
    "over-long prompt": (
        {"model": "tiny-qwen2", "prompt": [7] * 17_000, "max_tokens": 2},
        400,
        "prompt has 17000 tokens, max_model_len is 16384",
        "prompt",
    ),
    "over-long chat": (
        {**GOOD, "messages": [{"role": "user", "content": "x " * 17_000}]},
        400,
        "max_model_len is 16384",
        "messages",
    ),
    "bad base64 image": (
        {**GOOD, "messages": image_message("data:image/png;base64,iVBOR!!!w0KGgo")},
        400,
        "messages.0.content.0.image_url: not valid base64",
        "messages.0.content.0.image_url",
    ),
    "network image": (
        {**GOOD, "messages": image_message("https://example.com/cat.png")},
        400,
        "the server fetches nothing over the network",
        "messages.0.content.0.image_url",
    ),
    "file image": (
        {**GOOD, "messages": image_message("file:///etc/hostname")},
        400,
        "file: URLs are refused unless the server names --allowed-local-media-path",
        "messages.0.content.0.image_url",
    ),
    "image to a text model": (
        {**GOOD, "messages": image_message(PNG_URL)},
        400,
        "this model takes no image: its stage 'llm' reads no multi_modal_data",
        "messages",
    ),
    "audio from a text model": (
        {**GOOD, "modalities": ["text", "audio"]},
        400,
        "modalities: this server's stages ['llm'] write text only: it answers with text, not audio",
        "modalities",
    ),
    "a voice from a text model": (  # an audio object alone asks for audio
        {**GOOD, "audio": {"voice": "Chelsie", "format": "wav"}},
        400,
        "audio: this server's stages ['llm'] write text only",
        "audio",
    ),
    "wrong model": ({**GOOD, "model": "gpt-4o"}, 404, "the model 'gpt-4o' does not exist here", "model"),
    "top_logprobs alone": (
        {**GOOD, "top_logprobs": 2},
        400,
        "top_logprobs: asked without logprobs: true",
        "top_logprobs",
    ),
    "too many top_logprobs": (
        {**GOOD, "logprobs": True, "top_logprobs": 21},
        400,
        "top_logprobs: Input should be less than or equal to 20",
        "top_logprobs",
    ),
    "max_tokens past the context": (
        {"model": "tiny-qwen2", "prompt": [7] * 16_000, "max_tokens": 385},
        400,
        "'max_tokens' or 'max_completion_tokens' is too large: 385. This model's maximum context "
        "length is 16384 tokens and your request has 16000 input tokens (385 > 16384 - 16000)",
        "max_tokens",
    ),
    "max_completion_tokens past the context": (
        {**GOOD, "max_completion_tokens": 16_384},
        400,
        "'max_tokens' or 'max_completion_tokens' is too large: 16384. This model's maximum context",
        "max_completion_tokens",
    ),
    "too many completion logprobs": (
        {"model": "tiny-qwen2", "prompt": "x", "logprobs": 21},
        400,
        "logprobs: Input should be less than or equal to 20",
        "logprobs",
    ),
}
TYPES = {400: "invalid_request_error", 404: "not_found_error"}


@pytest.fixture(scope="module")
def good_ref(qwen) -> OmniRequestOutput:
    return chat_ref(qwen.ref, GOOD["messages"], temperature=0.0, max_tokens=3)


def check_good_request(http: httpx.Client, ref: OmniRequestOutput) -> None:
    r = http.post("/v1/chat/completions", json=GOOD)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == ref.text


@pytest.mark.parametrize("case", REFUSALS)
def test_a_bad_request_gets_openai_error_json_naming_the_problem(qwen, good_ref, case) -> None:
    body, status, says, param = REFUSALS[case]
    path = "/v1/completions" if isinstance(body, dict) and "prompt" in body else "/v1/chat/completions"
    refused_before = qwen.server.metrics().get(
        ("omni_jax:request_refused_total", (("status", str(status)),)), 0
    )
    with qwen.server.http() as http:
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        error = check_error(http.post(path, **kw), status, TYPES[status], says)
        assert error["param"] == param
        assert not error["message"].startswith("request ")  # run()'s prompt index: not the server's
        assert not error["message"].startswith("stage ")  # a stage the client never named
        check_good_request(http, good_ref)
    metrics = qwen.server.metrics()
    assert metrics[("omni_jax:request_refused_total", (("status", str(status)),))] == refused_before + 1
    assert metrics[("omni_jax:num_requests", ())] == 0


def test_a_request_without_model_is_served_by_the_served_model(qwen, good_ref) -> None:
    """vLLM's server takes a request that leaves ``model`` out; the reply names the served one."""
    with qwen.server.http() as http:
        r = http.post("/v1/chat/completions", json={k: v for k, v in GOOD.items() if k != "model"})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "tiny-qwen2"
    assert r.json()["choices"][0]["message"]["content"] == good_ref.text


def test_response_format_text_is_served_and_json_refused(qwen, good_ref) -> None:
    """SDKs send ``response_format: {"type": "text"}`` by default: the plain reply, as vLLM's
    server answers; a JSON format (guided decoding, which the server does not do) is refused."""
    with qwen.server.http() as http:
        r = http.post("/v1/chat/completions", json={**GOOD, "response_format": {"type": "text"}})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == good_ref.text
        r = http.post("/v1/chat/completions", json={**GOOD, "response_format": {"type": "json_object"}})
    error = check_error(r, 400, "invalid_request_error", "response_format.type: Input should be 'text'")
    assert error["param"] == "response_format.type"


def test_the_openai_client_reads_the_refusals(qwen) -> None:
    client = qwen.server.client()
    with pytest.raises(openai.BadRequestError, match="n: Input should be greater than or equal to 1") as e:
        client.chat.completions.create(model="tiny-qwen2", messages=MESSAGES[0], n=0)
    assert e.value.status_code == 400 and e.value.type == "invalid_request_error"
    with pytest.raises(openai.NotFoundError, match="does not exist here") as e:
        client.chat.completions.create(model="nope", messages=MESSAGES[0])
    assert e.value.param == "model"


def test_a_request_routing_refuses_gets_openai_error_json(qwen, good_ref) -> None:
    """An unknown path or a method a route does not take: OpenAI's error JSON, as every other
    refusal, counted by status, and the server serves on."""
    refused = qwen.server.metrics()
    with qwen.server.http() as http:
        check_error(http.get("/v1/nothing"), 404, "not_found_error", "Not Found")
        r = http.get("/v1/chat/completions")
        check_error(r, 405, "invalid_request_error", "Method Not Allowed")
        assert r.headers["allow"] == "POST"
        check_good_request(http, good_ref)
    metrics = qwen.server.metrics()
    for status in ("404", "405"):
        key = ("omni_jax:request_refused_total", (("status", status),))
        assert metrics[key] == refused.get(key, 0) + 1


@pytest.mark.parametrize("key", [None, "wrong-key", f"{API_KEY}x"], ids=["missing", "wrong", "longer"])
def test_a_missing_or_wrong_api_key_gets_401(qwen, good_ref, key) -> None:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=qwen.server.url, timeout=60) as http:
        for method, path, body in [
            ("POST", "/v1/chat/completions", GOOD),
            ("POST", "/v1/completions", {"model": "tiny-qwen2", "prompt": "x"}),
            ("GET", "/v1/models", None),
            ("GET", "/v1/nothing", None),  # the key comes before the route: no 404 without it
            ("POST", "/v1/chat/completions/", GOOD),  # nor a redirect telling the route exists
        ]:
            r = http.request(method, path, json=body, headers=headers)
            check_error(r, 401, "authentication_error", "a valid API key is required")
        assert http.get("/health").status_code == 200 and http.get("/metrics").status_code == 200
    if key is not None:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{qwen.server.url}/v1", api_key=key, max_retries=0).models.list()
    with qwen.server.http() as http:
        check_good_request(http, good_ref)


def test_a_trailing_slash_is_an_unknown_path_not_a_redirect(qwen) -> None:
    """Starlette would redirect it, with a Location taken from the Host header."""
    with qwen.server.http() as http:
        r = http.get("/metrics/", headers={"host": "elsewhere.example"})
        check_error(r, 404, "not_found_error", "Not Found")
        assert "location" not in r.headers


@pytest.mark.parametrize(
    "kind", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"]
)
def test_a_body_a_browser_sends_without_asking_is_refused_with_415(qwen, good_ref, kind) -> None:
    """A web page may post a form or plain text to any site without a CORS preflight: read as
    JSON, it would make a keyless server generate for any page its user opens. JSON (with a
    charset, or ``+json``) and no Content-Type at all are read, as FastAPI reads a JSON body."""
    before = qwen.server.metrics()
    with qwen.server.http() as http:
        body = json.dumps(GOOD).encode()
        for path in ("/v1/chat/completions", "/tokenize"):
            r = http.post(path, content=body, headers={"content-type": kind})
            check_error(
                r,
                415,
                "invalid_request_error",
                f"must be JSON (Content-Type: application/json), not {kind!r}",
            )
        for json_kind in ("application/json; charset=utf-8", "application/vnd.api+json"):
            r = http.post("/v1/chat/completions", content=body, headers={"content-type": json_kind})
            assert r.status_code == 200, r.text
        r = http.post("/v1/chat/completions", content=body)
        assert "content-type" not in r.request.headers and r.status_code == 200, r.text
    key = ("omni_jax:request_refused_total", (("status", "415"),))
    assert qwen.server.metrics()[key] == before.get(key, 0) + 2


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_a_body_over_the_limit_gets_413(qwen, good_ref, declared) -> None:
    body = json.dumps({**GOOD, "messages": [{"role": "user", "content": "x" * MAX_BODY}]}).encode()
    with qwen.server.http() as http:
        content = body if declared else iter([body[i : i + 8192] for i in range(0, len(body), 8192)])
        r = http.post("/v1/chat/completions", content=content, headers={"content-type": "application/json"})
        check_error(r, 413, "invalid_request_error", f"larger than the server's limit of {MAX_BODY} bytes")
        check_good_request(http, good_ref)
        # a body just under the limit is read (and refused for its prompt's length, not its size)
        small = json.dumps({**GOOD, "messages": [{"role": "user", "content": "x" * (MAX_BODY - 200)}]})
        assert len(small) <= MAX_BODY
        r = http.post("/v1/chat/completions", content=small, headers={"content-type": "application/json"})
        check_error(r, 400, "invalid_request_error", "max_model_len is 16384")


# -- disconnects ----------------------------------------------------------------------------------


def counters(server: Server) -> tuple[float, float, float]:
    """Requests ended by the engine (stop, length, error), requests aborted (their client gone)
    and reply tokens, as /metrics counts them."""
    m = server.metrics()
    ended = sum(
        v
        for (name, labels), v in m.items()
        if name == "omni_jax:request_success_total" and labels != (("finish_reason", "abort"),)
    )
    aborted = m.get(("omni_jax:request_success_total", (("finish_reason", "abort"),)), 0)
    return ended, aborted, m[("omni_jax:generation_tokens_total", ())]


def wait_idle(server: Server, timeout: float = 60) -> dict[Any, float]:
    """/metrics once no request is in the engine; fails after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = server.metrics()
        if m[("omni_jax:num_requests", ())] == 0:
            return m
        time.sleep(0.05)
    pytest.fail(f"requests still in the engine after {timeout} s: {server.metrics()}")


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_a_client_that_disconnects_aborts_its_request_and_the_others_finish(qwen, stream) -> None:
    """The doomed request asks for 16000 tokens (22 s) and is dropped after a few: it must leave
    the engine within seconds (its pages back) and never end: the counter of requests the engine
    ended grows by the others' alone, the aborted ones' by it, and the reply tokens by the
    others' and the few it made (a reply still read to its end would add its 16000). The log says
    so in one line, a stream's as a whole reply's."""
    server = qwen.server
    prompts = ["the model stream request", "what is the time", "tell me a story about a cat"]
    lengths = [30, 60, 45]
    refs = [
        chat_ref(qwen.ref, [{"role": "user", "content": p}], temperature=0.0, max_tokens=n, ignore_eos=True)
        for p, n in zip(prompts, lengths, strict=True)
    ]
    ended, aborted, tokens = counters(server)
    gone = "client disconnected; its request was aborted"  # what the server logs, once
    logged = server.log.read_text().count(gone)
    doomed = chat_body(
        "tiny-qwen2", "hello world the model", max_tokens=DOOMED_TOKENS, ignore_eos=True, stream=stream
    )

    async def other(http: httpx.AsyncClient, prompt: str, n: int) -> str:
        body = chat_body("tiny-qwen2", prompt, temperature=0, max_tokens=n, ignore_eos=True, stream=True)
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            text = ""
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    choices = json.loads(line[6:])["choices"]
                    text += choices[0]["delta"].get("content") or ""
            return text

    async def drop() -> int:
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=60) as http:
            if stream:
                async with http.stream("POST", "/v1/chat/completions", json=doomed) as r:
                    assert r.status_code == 200
                    seen = 0
                    async for line in r.aiter_lines():
                        seen += line.startswith("data: {")
                        if seen == 4:
                            break
                    return seen
            with pytest.raises(httpx.ReadTimeout):  # gives up while the reply is being written
                await http.post("/v1/chat/completions", json=doomed, timeout=httpx.Timeout(60, read=0.3))
            return 0

    async def scenario() -> tuple[list[str], int]:
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=120) as http:
            others = [asyncio.create_task(other(http, p, n)) for p, n in zip(prompts, lengths, strict=True)]
            seen = await drop()
            return await asyncio.gather(*others), seen

    texts, seen = asyncio.run(asyncio.wait_for(scenario(), 300))
    assert texts == [r.text for r in refs]
    assert seen == (4 if stream else 0)
    m = wait_idle(server, timeout=5)
    assert (
        m[("omni_jax:kv_pages_free", (("stage", "llm"),))]
        == m[("omni_jax:kv_pages_capacity", (("stage", "llm"),))]
    )
    time.sleep(0.5)  # a request still running would be counted as it ends
    now_ended, now_aborted, now_tokens = counters(server)
    assert (now_ended, now_aborted) == (ended + len(prompts), aborted + 1), server.log_tail()
    doomed_tokens = now_tokens - tokens - sum(lengths)
    assert (3 if stream else 0) <= doomed_tokens < DOOMED_TOKENS / 4, server.log_tail()
    assert server.log.read_text().count(gone) == logged + 1, server.log_tail()


def test_a_clients_request_id_names_its_reply(qwen) -> None:
    """``X-Request-Id`` (vLLM's header) makes the reply's ``id``, for one reply or several, and a
    client may reuse it while a request of that id still runs (both complete, as run() says); a
    header of spaces or past 256 characters is refused. Without the header, ids are random."""
    server = qwen.server
    with server.http() as http:
        body = chat_body("tiny-qwen2", "hello", max_tokens=4)
        r = http.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "trace-42"})
        assert (r.status_code, r.json()["id"]) == (200, "chatcmpl-trace-42")
        completion = {"model": "tiny-qwen2", "prompt": "hello", "max_tokens": 2, "n": 2}
        r = http.post("/v1/completions", json=completion, headers={"X-Request-Id": "trace-42"})
        assert (r.status_code, r.json()["id"], len(r.json()["choices"])) == (200, "cmpl-trace-42", 2)
        ids = {http.post("/v1/chat/completions", json=body).json()["id"] for _ in range(2)}
        assert len(ids) == 2 and all(re.fullmatch(r"chatcmpl-[0-9a-f]{32}", i) for i in ids)
        for bad in ("two words", "x" * 257):
            r = http.post("/v1/chat/completions", json=body, headers={"X-Request-Id": bad})
            assert r.status_code == 400
            assert r.json()["error"]["message"] == "X-Request-Id must be 1 to 256 visible ASCII characters"

    prompt, lengths = "hello", (LONG_TOKENS, 40)
    refs = [
        chat_ref(
            qwen.ref, [{"role": "user", "content": prompt}], temperature=0.0, max_tokens=n, ignore_eos=True
        )
        for n in lengths
    ]

    async def twice() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=120) as http:

            def send(n: int) -> Awaitable[httpx.Response]:
                body = chat_body("tiny-qwen2", prompt, temperature=0, max_tokens=n, ignore_eos=True)
                return http.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "same"})

            first = asyncio.create_task(send(lengths[0]))
            while server.metrics().get(("omni_jax:num_requests_running", (("stage", "llm"),)), 0) < 1:
                await asyncio.sleep(0.01)
            again = await send(lengths[1])
            return [await first, again]

    replies = asyncio.run(asyncio.wait_for(twice(), 120))
    assert [r.status_code for r in replies] == [200, 200]
    assert [r.json()["id"] for r in replies] == ["chatcmpl-same"] * 2
    assert [r.json()["choices"][0]["message"]["content"] for r in replies] == [ref.text for ref in refs]


# -- the queue --------------------------------------------------------------------------------------


def test_a_full_queue_gets_429_and_the_accepted_requests_complete(queue) -> None:
    """One request runs (``--max-num-seqs 1``), one waits (``--max-queue 1``): the next is refused
    while both are in; the two complete as run() says, and a request after them is served."""
    server = queue.server
    long_ref = chat_ref(queue.ref, MESSAGES[0], temperature=0.0, max_tokens=LONG_TOKENS, ignore_eos=True)
    short_ref = chat_ref(
        queue.ref, [{"role": "user", "content": "what is the time"}], temperature=0.0, max_tokens=8
    )
    long_body = chat_body(
        "queue", MESSAGES[0][0]["content"], temperature=0, max_tokens=LONG_TOKENS, stream=True
    )
    long_body["ignore_eos"] = True
    short_body = chat_body("queue", "what is the time", temperature=0, max_tokens=8)

    async def scenario() -> tuple[str, httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:
            async with http.stream("POST", "/v1/chat/completions", json=long_body) as running:
                assert running.status_code == 200
                lines = running.aiter_lines()
                events = [await anext(lines)]  # the role chunk: the request is in the engine
                waiting = asyncio.create_task(http.post("/v1/chat/completions", json=short_body))
                deadline = time.monotonic() + 60
                while server.metrics()[("omni_jax:queue_waiting", ())] < 1:
                    assert time.monotonic() < deadline and not waiting.done()
                    await asyncio.sleep(0.02)
                refused = await http.post("/v1/chat/completions", json=short_body)
                check_error(refused, 429, "rate_limit_error", "the server's queue is full", "max_waiting=1")
                assert refused.headers["retry-after"] == "1"
                with pytest.raises(openai.RateLimitError, match="queue is full"):
                    await openai.AsyncOpenAI(
                        base_url=f"{server.url}/v1", api_key="x", max_retries=0
                    ).completions.create(model="queue", prompt="x", max_tokens=2)
                events += [line async for line in lines]
            return "".join(
                e["choices"][0]["delta"].get("content", "") for e in sse_events(iter(events))
            ), await waiting

    long_text, short = asyncio.run(asyncio.wait_for(scenario(), 300))
    assert long_text == long_ref.text
    assert short.status_code == 200 and short.json()["choices"][0]["message"]["content"] == short_ref.text
    assert server.metrics()[("omni_jax:request_refused_total", (("status", "429"),))] == 2
    r = httpx.post(f"{server.url}/v1/chat/completions", json=short_body, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == short_ref.text


def test_several_replies_stream_while_one_waits_for_its_place(queue) -> None:
    """``--max-num-seqs 1``: of ``n=2`` replies one runs while the other waits for a place. The
    first's text streams as it is made (it used to wait for the second's first token, after the
    first had ended); ``n=3`` can never be admitted whole (one runs, one may wait): a 400
    naming ``n``, not a 429 to retry."""
    body = {"model": "queue", "prompt": "hello", "n": 2, "max_tokens": 200, "temperature": 0, "stream": True}
    arrivals: list[tuple[float, dict[str, Any]]] = []
    with queue.server.http() as http:
        # The server starts without a warm-up: a first request compiles the programs, which
        # would otherwise delay the first token past the whole decode after it.
        warm = http.post("/v1/completions", json={**body, "n": 1, "max_tokens": 2, "stream": False})
        assert warm.status_code == 200
        start = time.perf_counter()
        with http.stream("POST", "/v1/completions", json={**body, "ignore_eos": True}) as r:
            assert r.status_code == 200
            for event in sse_events(r.iter_lines()):
                arrivals.append((time.perf_counter() - start, event))
        error = check_error(
            http.post("/v1/completions", json={**body, "n": 3}),
            400,
            "invalid_request_error",
            "3 replies (n times the prompts) can never be admitted at once: the first stage runs 1 and "
            "--max-queue lets 1 wait",
        )
        assert error["param"] == "n"
    choice0 = [
        (t, e["choices"][0]) for t, e in arrivals if e.get("choices") and e["choices"][0]["index"] == 0
    ]
    first_text = next(t for t, c in choice0 if c["text"])
    finished = next(t for t, c in choice0 if c["finish_reason"])
    assert first_text < finished / 2, (first_text, finished)


# -- metrics -----------------------------------------------------------------------------------------

METRIC_NAMES = {
    "counter": [
        "omni_jax:request_success",
        "omni_jax:request_refused",
        "omni_jax:prompt_tokens",
        "omni_jax:generation_tokens",
        "omni_jax:audio_seconds",
        "omni_jax:xla_compilations",
    ],
    "histogram": [
        "omni_jax:time_to_first_token_seconds",
        "omni_jax:time_to_first_audio_seconds",
        "omni_jax:e2e_request_latency_seconds",
    ],
    "gauge": [
        "omni_jax:num_requests_running",
        "omni_jax:num_requests_waiting",
        "omni_jax:kv_pages_free",
        "omni_jax:kv_pages_capacity",
        "omni_jax:num_requests",
        "omni_jax:queue_waiting",
    ],
}


def test_metrics_are_prometheus_text_with_the_servers_names(qwen) -> None:
    """After a request of known size, its counts are there; the engine gauges read idle; and no
    XLA compilation happened since warm-up, whatever this module's requests were (run after
    them: prompts from 7 to 22 tokens, replies up to 16000, batches of 1 to 4)."""
    ref = chat_ref(qwen.ref, MESSAGES[0], temperature=0.0, max_tokens=5, ignore_eos=True)
    before = qwen.server.metrics()
    client = qwen.server.client()
    client.chat.completions.create(
        model="tiny-qwen2", messages=MESSAGES[0], temperature=0, max_tokens=5, extra_body={"ignore_eos": True}
    )
    r = httpx.get(f"{qwen.server.url}/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = {f.name: f.type for f in text_string_to_metric_families(r.text)}
    for kind, names in METRIC_NAMES.items():
        for name in names:
            assert families.get(name) == kind, (name, families)
    after = qwen.server.metrics()

    def grew(name: str, labels: tuple[tuple[str, str], ...] = ()) -> float:
        return after[(name, labels)] - before.get((name, labels), 0)

    assert grew("omni_jax:request_success_total", (("finish_reason", "length"),)) == 1
    assert grew("omni_jax:prompt_tokens_total") == len(ref.prompt_token_ids)
    assert grew("omni_jax:generation_tokens_total") == 5
    assert grew("omni_jax:e2e_request_latency_seconds_count") == 1
    assert grew("omni_jax:time_to_first_token_seconds_count") == 1
    assert grew("omni_jax:time_to_first_audio_seconds_count") == 0
    llm = (("stage", "llm"),)
    assert after[("omni_jax:num_requests_running", llm)] == after[("omni_jax:num_requests_waiting", llm)] == 0
    assert after[("omni_jax:kv_pages_free", llm)] == after[("omni_jax:kv_pages_capacity", llm)] > 0
    compiled = ("omni_jax:xla_compilations_total", ())
    assert after[compiled] == qwen.server.at_ready[compiled] >= 21  # warm-up's programs, then none


# -- the Omni server: text and audio ----------------------------------------------------------------

VOICES = ("Chelsie", "Ethan")


def omni_ref(
    served: Served,
    messages: list[dict[str, Any]],
    voice: str | None,
    seed: int,
    max_tokens: int,
    stream: bool = False,
    **fields: Any,
) -> OmniRequestOutput:
    """run() for an Omni request: speaking in ``voice``, or text only when it is ``None``;
    ``stream``: as the server runs a streamed reply."""
    prompt = served.ref.chat_prompt(messages)
    prompt["modalities"] = ["text"] if voice is None else ["text", "audio"]
    if voice is not None:
        prompt["speaker"] = voice
    params = stage_params(served.ref, seed, stream, temperature=0.0, max_tokens=max_tokens, **fields)
    out = run_one(served.ref, prompt, params)
    assert (out.audio is not None) == (voice is not None)
    return out


def decode_audio(data: str, fmt: str) -> np.ndarray:
    raw = base64.b64decode(data)
    if fmt == "pcm16":
        return np.frombuffer(raw, "<i2")
    rate, samples = wavfile.read(io.BytesIO(raw))
    assert rate == 24_000 and samples.dtype == np.int16
    return samples


def omni_request(
    messages: list[dict[str, Any]], voice: str, fmt: str, seed: int, max_tokens: int
) -> dict[str, Any]:
    return dict(
        model="tiny-omni",
        messages=messages,
        temperature=0,
        max_tokens=max_tokens,
        seed=seed,
        modalities=["text", "audio"],
        audio={"voice": voice, "format": fmt},
    )


def test_omni_serves_at_once_without_warmup(omni) -> None:
    assert [status for status, _ in omni.server.warming] == [200]
    assert "warm-up compiled" not in omni.server.log.read_text()
    (model,) = omni.server.client().models.list().data
    assert model.id == "tiny-omni"


STORY = [{"role": "user", "content": "tell me a story about a cat"}]


@pytest.mark.parametrize("fmt", ["wav", "pcm16"])
def test_text_and_audio_equal_run(omni, fmt) -> None:
    client = omni.server.client()
    r, ref = alongside(
        lambda: client.chat.completions.create(**omni_request(STORY, "Ethan", fmt, seed=11, max_tokens=12)),
        lambda: omni_ref(omni, STORY, "Ethan", seed=11, max_tokens=12),
    )
    want = pcm16(ref.audio)
    assert want.size > 0
    message = r.choices[0].message
    assert message.content == ref.text and r.choices[0].finish_reason == ref.finish_reason
    assert message.audio.transcript == ref.text and message.audio.id.startswith("audio-")
    np.testing.assert_array_equal(decode_audio(message.audio.data, fmt), want)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (
        len(ref.prompt_token_ids),
        len(ref.token_ids),
    )

    # Streamed, the audio is decoded chunk by chunk as the talker speaks: run()'s with stream=True.
    streamed = omni_ref(omni, STORY, "Ethan", seed=11, max_tokens=12, stream=True)
    assert streamed.stage_outputs["talker"].token_ids == ref.stage_outputs["talker"].token_ids
    chunks = list(client.chat.completions.create(stream=True, **omni_request(STORY, "Ethan", fmt, 11, 12)))
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(d.content or "" for d in deltas) == ref.text
    # OpenAI's streamed transcript: the text again, in the audio object of each text chunk.
    spoken = [d for d in deltas if d.audio is not None]
    assert "".join(d.audio.transcript for d in spoken) == ref.text
    assert all(d.audio.transcript == d.content for d in spoken if d.audio.data is None)
    assert len({(d.audio.id, d.audio.expires_at) for d in spoken}) == 1  # one reply, one audio
    pieces = [decode_audio(d.audio.data, fmt) for d in spoken if d.audio.data is not None]
    assert len(pieces) == streamed.metrics["code2wav"]["chunks"] > 1
    assert all(d.content is None for d in spoken if d.audio.data is not None)
    if fmt == "pcm16":
        np.testing.assert_array_equal(np.concatenate(pieces), pcm16(streamed.audio))
    else:  # each piece a WAV of its own samples
        for piece, lo in zip(pieces, np.cumsum([0] + [len(p) for p in pieces[:-1]]), strict=True):
            np.testing.assert_array_equal(piece, pcm16(streamed.audio[lo : lo + len(piece)]))
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_spoken_reply_is_referred_to_by_its_audio_id(omni, stream) -> None:
    """OpenAI's multi-turn audio: the next request sends the spoken reply back as ``{"role":
    "assistant", "audio": {"id": ...}}``, without content, and it stands for what the reply
    said: the same reply as with the transcript written out. An id not kept (or audio in
    another role's message) is a 400 naming the field."""
    client = omni.server.client()
    first = omni_request(STORY, "Chelsie", "pcm16", seed=3, max_tokens=6)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **first))
        spoken = [c.choices[0].delta.audio for c in chunks if c.choices and c.choices[0].delta.audio]
        audio_id, said = spoken[0].id, "".join(a.transcript for a in spoken)
    else:
        message = client.chat.completions.create(**first).choices[0].message
        audio_id, said = message.audio.id, message.audio.transcript
    assert said
    follow = [{"role": "user", "content": "and then?"}]
    by_id, written = (
        client.chat.completions.create(**omni_request(STORY + [turn] + follow, "Chelsie", "pcm16", 4, 6))
        for turn in ({"role": "assistant", "audio": {"id": audio_id}}, {"role": "assistant", "content": said})
    )
    assert by_id.usage.prompt_tokens == written.usage.prompt_tokens
    assert by_id.choices[0].message.content == written.choices[0].message.content
    with omni.server.http() as http:
        unknown = {"role": "assistant", "audio": {"id": "audio-chatcmpl-elsewhere"}}
        r = http.post(
            "/v1/chat/completions", json=omni_request(STORY + [unknown] + follow, "Chelsie", "wav", 4, 6)
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages.1.audio.id"
        assert (
            "no spoken reply's audio of id 'audio-chatcmpl-elsewhere' is kept here"
            in r.json()["error"]["message"]
        )
        user = {"role": "user", "content": "hi", "audio": {"id": audio_id}}
        r = http.post("/v1/chat/completions", json=omni_request([user], "Chelsie", "wav", 4, 6))
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.audio"
        if not stream:  # replies of one reused X-Request-Id: each keeps its own audio id
            reused = [
                http.post(
                    "/v1/chat/completions",
                    json=omni_request(STORY, "Chelsie", "wav", seed=seed, max_tokens=6),
                    headers={"X-Request-Id": "mine"},
                ).json()
                for seed in (3, 4)
            ]
            assert [r["id"] for r in reused] == ["chatcmpl-mine"] * 2
            assert len({r["choices"][0]["message"]["audio"]["id"] for r in reused}) == 2


def test_the_seed_decides_the_spoken_audio(omni) -> None:
    """The talker samples (temperature 0.9 in the YAML): another seed, another code sequence."""
    refs = [omni_ref(omni, STORY, "Chelsie", seed=s, max_tokens=12) for s in (11, 1)]
    assert refs[0].text == refs[1].text  # the thinker is greedy
    assert refs[0].stage_outputs["talker"].token_ids != refs[1].stage_outputs["talker"].token_ids
    client = omni.server.client()
    for seed, ref in zip((11, 1), refs, strict=True):
        assert ref.audio.size > 0
        r = client.chat.completions.create(**omni_request(STORY, "Chelsie", "pcm16", seed, 12))
        np.testing.assert_array_equal(
            decode_audio(r.choices[0].message.audio.data, "pcm16"), pcm16(ref.audio)
        )


def test_a_reply_with_no_codes_still_carries_its_empty_audio(omni) -> None:
    ref = omni_ref(omni, STORY, "Chelsie", seed=2, max_tokens=12)
    assert ref.stage_outputs["talker"].token_ids == [OMNI_CODEC["tts_codec_end_token_id"]]
    assert ref.audio.size == 0  # the codec EOS at once
    r = omni.server.client().chat.completions.create(**omni_request(STORY, "Chelsie", "wav", 2, 12))
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].message.audio is not None
    assert decode_audio(r.choices[0].message.audio.data, "wav").size == 0


def test_the_voice_picks_the_speaker(omni) -> None:
    """Each voice is run()'s ``speaker``; the voices differ. Ethan's request leaves out
    ``modalities``: an ``audio`` object alone asks for text and audio (OpenAI's convention)."""
    refs = {v: omni_ref(omni, STORY, v, seed=5, max_tokens=10) for v in VOICES}
    assert all(ref.audio.size > 0 for ref in refs.values())
    chelsie, ethan = (pcm16(refs[v].audio) for v in VOICES)
    assert chelsie.shape != ethan.shape or not np.array_equal(chelsie, ethan)
    client = omni.server.client()
    for voice in VOICES:
        body = omni_request(STORY, voice, "wav", seed=5, max_tokens=10)
        if voice == "Ethan":
            del body["modalities"]
        r = client.chat.completions.create(**body)
        np.testing.assert_array_equal(
            decode_audio(r.choices[0].message.audio.data, "wav"), pcm16(refs[voice].audio)
        )


def test_image_and_audio_input_in_one_message(omni) -> None:
    t = np.arange(16_000) / 16_000
    tone = (0.3 * np.sin(2 * np.pi * 330 * t)).astype(np.float32)
    wav = wav_bytes(tone, 16_000)
    parts = [
        {"type": "image_url", "image_url": {"url": PNG_URL}},
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}},
        {"type": "text", "text": "what do you see and hear"},
    ]
    image = Image.open(io.BytesIO(PNG.getvalue())).convert("RGB")
    media = [
        {"type": "image", "image": image},
        {"type": "audio", "audio": read_audio_file(io.BytesIO(wav), 16_000)},
        {"type": "text", "text": "what do you see and hear"},
    ]
    client = omni.server.client()
    r, ref = alongside(
        lambda: client.chat.completions.create(
            **omni_request([{"role": "user", "content": parts}], "Chelsie", "wav", seed=3, max_tokens=10)
        ),
        lambda: omni_ref(omni, [{"role": "user", "content": media}], "Chelsie", seed=3, max_tokens=10),
    )
    text_only = omni.ref.chat_prompt([{"role": "user", "content": "what do you see and hear"}])["prompt"]
    # the media's tokens are in the prompt
    assert len(ref.prompt_token_ids) > len(omni.ref.tokenizer(text_only)["input_ids"]) + 10
    assert r.choices[0].message.content == ref.text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    np.testing.assert_array_equal(decode_audio(r.choices[0].message.audio.data, "wav"), pcm16(ref.audio))
    # vLLM's /tokenize counts the messages as the request was counted: the media expanded.
    with omni.server.http() as http:
        counted = http.post("/tokenize", json={"messages": [{"role": "user", "content": parts}]}).json()
    assert counted["tokens"] == ref.prompt_token_ids and counted["count"] == r.usage.prompt_tokens


def test_an_image_the_processor_refuses_is_named_by_its_content_part(omni) -> None:
    """An image whose aspect ratio the image processor's resize refuses (past 200:1), the second
    of a message's two: the 400 names its content part, as a part the server cannot read is
    named, on a request and on vLLM's ``/tokenize`` alike; the server serves on."""
    wide = io.BytesIO()
    Image.new("RGB", (500, 2)).save(wide, format="PNG")
    wide_url = f"data:image/png;base64,{base64.b64encode(wide.getvalue()).decode()}"
    parts = [
        {"type": "image_url", "image_url": {"url": PNG_URL}},
        {"type": "text", "text": "and this one"},
        {"type": "image_url", "image_url": {"url": wide_url}},
    ]
    messages = [{"role": "user", "content": parts}]
    says = "messages.0.content.2.image_url: absolute aspect ratio must be smaller than 200, got 250.0"
    with omni.server.http() as http:
        body = {"model": "tiny-omni", "messages": messages, "max_tokens": 2}
        for path, sent in (("/v1/chat/completions", body), ("/tokenize", {"messages": messages})):
            error = check_error(http.post(path, json=sent), 400, "invalid_request_error", says)
            assert (error["message"], error["param"]) == (says, "messages.0.content.2.image_url"), path
        parts[2] = parts[0]
        assert http.post("/v1/chat/completions", json=body).status_code == 200


def test_a_video_file_with_its_own_sound_and_an_mp3(omni, tmp_path) -> None:
    """An mp4 (sampled at the model's rate, its AAC track heard with it: vLLM's
    ``mm_processor_kwargs``) and an mp3 ``input_audio``, as run() reads the same files."""
    clip = write_video(tmp_path / "clip.mp4", gradient_frames(50, 48, 64), 25, tone(2, 22050, channels=2))
    mp3 = write_audio(tmp_path / "a.mp3", tone(1.5, 44100, hz=330), 44100, "mp3")
    url = "data:video/mp4;base64," + base64.b64encode(clip.read_bytes()).decode()
    said = {"data": base64.b64encode(mp3.read_bytes()).decode(), "format": "mp3"}
    watch = [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "what happens"}]
    listen = [{"type": "input_audio", "input_audio": said}, {"type": "text", "text": "and this"}]
    client = omni.server.client()
    for parts, media, kwargs in (
        (watch, [{"type": "video", "video": str(clip)}, watch[1]], {"use_audio_in_video": True}),
        (listen, [{"type": "audio", "audio": str(mp3)}, listen[1]], {}),
    ):
        body = omni_request([{"role": "user", "content": parts}], "Chelsie", "wav", seed=3, max_tokens=8)
        prompt = omni.ref.chat_prompt([{"role": "user", "content": media}], **kwargs)
        prompt.update(modalities=["text", "audio"], speaker="Chelsie")
        params = stage_params(omni.ref, 3, False, temperature=0.0, max_tokens=8)
        r, ref = alongside(
            lambda body=body, kwargs=kwargs: client.chat.completions.create(
                **body, extra_body={"mm_processor_kwargs": kwargs} if kwargs else None
            ),
            lambda prompt=prompt, params=params: run_one(omni.ref, prompt, params),
        )
        assert r.choices[0].message.content == ref.text
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
        np.testing.assert_array_equal(decode_audio(r.choices[0].message.audio.data, "wav"), pcm16(ref.audio))
        with omni.server.http() as http:  # vLLM's /tokenize counts them as the request was counted
            body = {"messages": [{"role": "user", "content": parts}], "mm_processor_kwargs": kwargs}
            assert http.post("/tokenize", json=body).json()["tokens"] == ref.prompt_token_ids
    with omni.server.http() as http:
        body = dict(model="tiny-omni", messages=[{"role": "user", "content": watch}], max_tokens=4)
        body["mm_processor_kwargs"] = {"use_audio_in_video": True, "fps": 0}
        check_error(
            http.post("/v1/chat/completions", json=body),
            400,
            "invalid_request_error",
            "mm_processor_kwargs.fps: ",
        )
        silent = write_video(tmp_path / "silent.mp4", gradient_frames(50, 48, 64), 25)
        watch[0]["video_url"]["url"] = (
            "data:video/mp4;base64," + base64.b64encode(silent.read_bytes()).decode()
        )
        body["mm_processor_kwargs"] = {"use_audio_in_video": True}
        check_error(
            http.post("/v1/chat/completions", json=body),
            400,
            "invalid_request_error",
            "video 0 (bytes) holds no audio stream",
        )


def test_a_whole_reply_speaks_in_openais_compressed_formats(omni) -> None:
    """mp3, flac, opus and aac, as OpenAI serves them, encoded from the reply's samples: flac
    decodes to the WAV reply's 16-bit samples exactly, the lossy ones to the same tone; a streamed
    reply asking for one is refused (its chunks are wav or pcm16)."""
    ref = omni_ref(omni, STORY, "Chelsie", seed=5, max_tokens=10)
    expected = pcm16(ref.audio).astype(np.float32) / 32768
    client = omni.server.client()
    for fmt in ("flac", "mp3", "opus", "aac"):
        r = client.chat.completions.create(**omni_request(STORY, "Chelsie", fmt, seed=5, max_tokens=10))
        assert r.choices[0].message.content == ref.text
        got, rate = read_audio(base64.b64decode(r.choices[0].message.audio.data))
        if fmt == "flac":
            assert rate == 24_000
            np.testing.assert_array_equal(got, expected)
            continue
        assert rate == (48_000 if fmt == "opus" else 24_000)  # Opus decodes at 48 kHz
        got = resample(got, rate, 24_000)
        assert abs(got.size - expected.size) <= 2048 + expected.size // 100  # codec delay and padding
        assert 0.5 < np.sqrt(np.mean(got**2) / np.mean(expected**2)) < 2  # the reply, not silence
    with omni.server.http() as http:
        body = omni_request(STORY, "Chelsie", "mp3", seed=5, max_tokens=4)
        check_error(
            http.post("/v1/chat/completions", json={**body, "stream": True}),
            400,
            "invalid_request_error",
            "audio.format: a streamed reply's audio comes in ['wav', 'pcm16'] chunks",
        )


def test_an_unknown_voice_is_refused_and_the_next_request_served(omni) -> None:
    with omni.server.http() as http:
        body = omni_request(STORY, "Nobody", "wav", seed=1, max_tokens=4)
        error = check_error(
            http.post("/v1/chat/completions", json=body),
            400,
            "invalid_request_error",
            "unknown speaker 'Nobody'",
        )
        assert "Chelsie" in error["message"] and "Ethan" in error["message"]
        assert error["param"] == "audio.voice"
        body = omni_request(STORY, "Ethan", "wav", seed=1, max_tokens=4)
        body["stop"] = ["x"]
        check_error(http.post("/v1/chat/completions", json=body), 400, "invalid_request_error", "stop: ")
    ref = omni_ref(omni, STORY, None, seed=1, max_tokens=4)
    r = omni.server.client().chat.completions.create(
        model="tiny-omni", messages=STORY, temperature=0, max_tokens=4, seed=1
    )
    assert r.choices[0].message.content == ref.text and r.choices[0].message.audio is None


# -- 32 concurrent streams ----------------------------------------------------------------------------

CONCURRENT = 32


def concurrent_case(i: int) -> tuple[list[dict[str, Any]], str | None, int, int]:
    """Request ``i``: its messages, its voice (every eighth speaks, voices alternating),
    max_tokens and seed."""
    messages = [{"role": "user", "content": f"request {i}: tell me about the number {i * 7}"}]
    return messages, (VOICES[(i // 8) % 2] if i % 8 == 3 else None), 3 + (i * 5) % 23, 100 + i


def test_32_concurrent_streams_all_complete_unmixed(omni) -> None:
    """All sent at once (the thinker runs 4 at a time, the rest queue), every one streamed."""
    cases = [concurrent_case(i) for i in range(CONCURRENT)]
    assert sum(voice is not None for _, voice, _, _ in cases) == 4
    client = omni.server.async_client()

    async def one(
        messages: list[dict[str, Any]], voice: str | None, n: int, seed: int
    ) -> tuple[str, Any, Any]:
        fields: dict[str, Any] = dict(
            model="tiny-omni", messages=messages, temperature=0, max_tokens=n, seed=seed
        )
        if voice is not None:
            fields.update(modalities=["text", "audio"], audio={"voice": voice, "format": "pcm16"})
        stream = await client.chat.completions.create(stream=True, extra_body={"ignore_eos": True}, **fields)
        text, audio, finish = "", [], None
        async for chunk in stream:
            delta = chunk.choices[0].delta
            text += delta.content or ""
            if delta.audio is not None and delta.audio.data is not None:
                audio.append(decode_audio(delta.audio.data, "pcm16"))
            finish = chunk.choices[0].finish_reason or finish
        return text, (np.concatenate(audio) if audio else None), finish

    async def all_at_once() -> list[tuple[str, Any, Any]]:
        return await asyncio.gather(*(one(*case) for case in cases))

    def references() -> list[OmniRequestOutput]:
        prompts, params = [], []
        for messages, voice, n, seed in cases:
            prompt = omni.ref.chat_prompt(messages)
            prompt["modalities"] = ["text"] if voice is None else ["text", "audio"]
            if voice is not None:
                prompt["speaker"] = voice
            prompts.append(prompt)
            params.append(stage_params(omni.ref, seed, True, temperature=0.0, max_tokens=n, ignore_eos=True))
        return omni.ref.run(prompts, [list(stage) for stage in zip(*params, strict=True)], progress=False)

    results, refs = alongside(lambda: asyncio.run(asyncio.wait_for(all_at_once(), 300)), references)
    assert len({r.text for r in refs}) == CONCURRENT  # every reply differs: a mix-up shows
    for i, ((text, audio, finish), ref, (_, voice, n, _)) in enumerate(
        zip(results, refs, cases, strict=True)
    ):
        assert (text, finish) == (ref.text, "length") and len(ref.token_ids) == n, i
        if voice is None:
            assert audio is None and ref.audio is None, i
        else:
            assert ref.audio.size > 0 and audio is not None, i
            np.testing.assert_array_equal(audio, pcm16(ref.audio), err_msg=f"request {i}")
    m = wait_idle(omni.server)
    for stage in ("thinker", "talker"):
        labels = (("stage", stage),)
        assert m[("omni_jax:kv_pages_free", labels)] == m[("omni_jax:kv_pages_capacity", labels)]


def test_shutdown_timeout_cuts_what_is_left_and_answers_the_queued(qwen_dir, tmp_path) -> None:
    """``--shutdown-timeout 3``: SIGTERM drains for 3 s, then cuts what is still running (a
    stream under way ends where it is, with an error event saying why and ``[DONE]``) and answers
    a request still queued with a 503 saying so; the server exits at once after, each cut logged
    in one line, no traceback. Without the timeout the drain had no end (122 s for long replies),
    past any orchestrator's grace period; the queued request got a plain-text 500 and the log a
    traceback. The cut stream used to stop mid-body: clients saw a broken connection, and
    uvicorn logged an ERROR for it ("ASGI callable returned without completing response")."""
    sizes = dict(QWEN_SIZES, max_num_seqs=1)
    args = ["--no-warmup", "--shutdown-timeout", "3", *size_args(sizes)]
    server = Server("drain", qwen_dir, tmp_path / "drain.log", *args).start()
    try:
        server.wait_healthy()
        running = threading.Event()

        def long_stream() -> list[str]:
            body = chat_body("drain", "hello", max_tokens=DOOMED_TOKENS, ignore_eos=True, stream=True)
            lines: list[str] = []
            with server.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    running.set()
            return lines

        with ThreadPoolExecutor(2) as pool:
            streamed = pool.submit(long_stream)
            assert running.wait(120), server.log_tail()
            with server.http() as http:
                queued = pool.submit(
                    http.post, "/v1/chat/completions", json=chat_body("drain", "hi", max_tokens=4)
                )
                # The queued request is in (max_num_seqs 1: it waits) before the signal.
                waiting = ("omni_jax:queue_waiting", ())
                deadline = time.monotonic() + 60
                while server.metrics()[waiting] < 1 and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert server.metrics()[waiting] == 1, server.log_tail()
                assert server.proc is not None
                signalled = time.monotonic()
                server.proc.terminate()
                server.proc.wait(60)
                took = time.monotonic() - signalled
                r = queued.result()
            lines = streamed.result()
        assert 3.0 <= took < 13.0, took
        check_error(r, 503, "service_unavailable", "the server is shutting down")
        events = [line for line in lines if line]
        assert events[-1] == "data: [DONE]" and events.count("data: [DONE]") == 1, events[-3:]
        cut = json.loads(events[-2].removeprefix("data: "))
        assert cut == {
            "error": {
                "message": "the server is shutting down: the stream was cut",
                "type": "service_unavailable",
                "param": None,
                "code": 503,
            }
        }
        assert all('"finish_reason":"' not in line for line in events)  # cut, not ended
        log = server.log.read_text(errors="replace")
        assert "cut by the shutdown mid-response" in log and "cut by the shutdown before it answered" in log
        assert "Traceback" not in log and "without completing response" not in log, server.log_tail()
    finally:
        server.stop()
