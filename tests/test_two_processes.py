"""Two processes on this machine, joined by ``jax.distributed`` (CPU collectives over gloo),
serve one mesh spanning both; process 0's outputs equal a single-process run."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
from parity import SPLIT_ROUNDING, rel_err
from stage_yamls import edited_stages

from omni_jax import OmniJaxPipeline, SamplingParams, Token2WavParams

HERE = Path(__file__).parent
MESH = {"data": 2, "model": 2}  # two devices per process: data spans the processes
ENGINE = dict(max_num_seqs=4, page_size=8, max_model_len=64)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def start_two(model_dir: Path, spec: dict, tmp_path: Path) -> tuple[dict, dict]:
    """Both processes' JSON results for ``spec`` (see ``two_process_worker.py``), each having
    exited cleanly."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(spec))
    port = free_port()
    procs, logs = [], []
    for pid in range(2):
        env = {
            **os.environ,
            "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
            "JAX_PLATFORMS": "cpu",  # the worker's own default, which an inherited platform would override
            "JAX_COORDINATOR_ADDRESS": f"localhost:{port}",
            "JAX_NUM_PROCESSES": "2",
            "JAX_PROCESS_ID": str(pid),
        }
        log = open(tmp_path / f"p{pid}.log", "w")
        logs.append(log)
        cmd = [
            sys.executable,
            str(HERE / "two_process_worker.py"),
            str(model_dir),
            str(spec_file),
            str(tmp_path / f"p{pid}.json"),
        ]
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        codes = [p.wait(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for log in logs:
            log.close()
    text = "\n".join((tmp_path / f"p{i}.log").read_text()[-3000:] for i in range(2))
    assert codes == [0, 0], text
    main, other = (json.loads((tmp_path / f"p{i}.json").read_text()) for i in range(2))
    return main, other


def run_two(model_dir: Path, spec: dict, tmp_path: Path) -> tuple[dict, dict]:
    """Both processes' results for ``spec``, run as one pipeline over both."""
    main, other = start_two(model_dir, spec, tmp_path)
    assert [main["process_count"], main["global_devices"], main["mesh_processes"]] == [2, 4, [0, 1]]
    assert other["token_ids"] == [] and other["audio"] == []  # only process 0 returns outputs
    return main, other


def test_two_processes_equal_one(qwen2_dir, tmp_path) -> None:
    rs = np.random.RandomState(2)
    prompts = [{"prompt_token_ids": [int(t) for t in rs.randint(3, 300, size=n)]} for n in (4, 11, 7)]
    params = [
        dict(temperature=0.0, max_tokens=6, ignore_eos=True),
        dict(temperature=0.8, top_k=20, seed=11, max_tokens=6, ignore_eos=True),
        dict(temperature=0.0, max_tokens=6, ignore_eos=True),
    ]
    spec = {"mesh": MESH, "engine": ENGINE, "prompts": prompts, "params": params}
    main, _ = run_two(qwen2_dir, spec, tmp_path)
    assert main["q_local_shards"] == [[64, 32], [64, 32]]  # each local device holds half the heads

    single = OmniJaxPipeline.from_pretrained(qwen2_dir, **ENGINE)
    want = single.run(prompts, [SamplingParams(**p) for p in params], progress=False)
    assert main["token_ids"] == [o.token_ids for o in want]


def test_code2wav_across_two_processes(omni_dir, tmp_path) -> None:
    """A code2wav stage whose mesh spans both processes (requests split over ``data`` across
    them, DiT blocks over ``model``): process 0 reads every waveform back, equal to one process's."""
    prompts = [{"prompt_token_ids": [1, 5, 9, 2, 7, 3][: 3 + i]} for i in range(3)]
    params = [dict(num_steps=3, seed=i) for i in range(3)]
    spec = {"mesh": MESH, "engine": {}, "stages": ["code2wav"], "prompts": prompts, "params": params}
    main, _ = run_two(omni_dir, spec, tmp_path)
    assert main["q_local_shards"] == [[32, 16], [32, 16]]  # the DiT's q columns halved per device

    single = OmniJaxPipeline.from_pretrained(omni_dir, stages=["code2wav"])
    want = single.run(prompts, [Token2WavParams(**p) for p in params], progress=False)
    assert len(main["audio"]) == len(want)
    for got, w in zip(main["audio"], want, strict=True):
        assert rel_err(np.asarray(got, np.float32), w.audio) < SPLIT_ROUNDING


def test_code2wav_across_two_processes_compiles_nothing_after_warmup(omni_dir, tmp_path) -> None:
    """Reading a solve's waveforms back from the other process's devices runs a gather program
    of the solve's shape: ``warmup()`` builds each one, so the run compiles nothing (it compiled
    one gather per solve shape). Small solve limits keep the warm-up to a few programs."""
    config = edited_stages(
        tmp_path / "stages.yaml",
        "qwen2_5_omni",
        code2wav={"engine": {"max_batch": 2, "max_codes": 32, "max_solve_codes": 64, "stream": False}},
    )
    prompts = [{"prompt_token_ids": [1, 5, 9, 2, 7, 3][: 3 + i]} for i in range(3)]
    params = [dict(num_steps=3, seed=i) for i in range(3)]
    engine = {"stage_config": str(config)}
    spec = {"mesh": MESH, "engine": engine, "stages": ["code2wav"], "prompts": prompts, "params": params}
    main, other = run_two(omni_dir, {**spec, "warmup": True}, tmp_path)
    assert main["compiles_after_warmup"] == other["compiles_after_warmup"] == 0

    single = OmniJaxPipeline.from_pretrained(omni_dir, stages=["code2wav"], **engine)
    want = single.run(prompts, [Token2WavParams(**p) for p in params], progress=False)
    for got, w in zip(main["audio"], want, strict=True):
        assert rel_err(np.asarray(got, np.float32), w.audio) < SPLIT_ROUNDING


def test_processes_given_other_arguments_or_prompts_refuse_alike(qwen2_dir, tmp_path) -> None:
    """Each process fills its own devices from its own inputs: process 1 given another prompt of
    the same length would have made process 0 answer process 1's prompt, and another engine
    size would hang a collective. Both are refused, in both processes, naming process 1."""
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9]}]
    params = [dict(temperature=0.0, max_tokens=4, ignore_eos=True)]
    spec = {"mesh": MESH, "engine": ENGINE, "prompts": prompts, "params": params}
    other_prompt = {**spec, "prompts_of": {"1": [{"prompt_token_ids": [9, 8, 7, 6, 5]}]}}
    for result in start_two(qwen2_dir, other_prompt, tmp_path / "prompt"):
        assert result == {
            "error": "process(es) [1] were given other prompts or sampling params than process 0: "
            "every process must run the same script with the same arguments and prompts"
        }
    other_engine = {**spec, "engine_of": {"1": {"max_num_seqs": 8}}}
    for result in start_two(qwen2_dir, other_engine, tmp_path / "engine"):
        assert result["error"].startswith("process(es) [1] were given other engine arguments or stage config")
