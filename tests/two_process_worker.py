"""One process of ``test_two_processes.py``: joins the run through the environment, writes JSON.

Started as ``python tests/two_process_worker.py MODEL_DIR SPEC_JSON OUT_JSON`` with
``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` set, exactly as a
user would start each host. The spec names the mesh, the engine settings, the stages (an AR
stage, or ``["code2wav"]``), the prompts and their params; ``engine_of`` and ``prompts_of``
(by process id) give one process other ones, whose refusal (``ValueError``) is then its result.
With ``"warmup": true`` the pipeline is warmed up first, and the result counts the XLA programs
the run then compiled (``compiles_after_warmup``).
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("OMNI_JAX_COMPILATION_CACHE", "0")


def main(model_dir: str, spec_json: str, out_json: str) -> None:
    import jax
    from flax import nnx

    from omni_jax import OmniJaxPipeline, SamplingParams, Token2WavParams
    from omni_jax.engine.compilation import CompileCounter

    spec = json.loads(open(spec_json).read())
    stages = spec.get("stages")
    me = os.environ["JAX_PROCESS_ID"]
    engine = {**spec["engine"], **spec.get("engine_of", {}).get(me, {})}
    generation = stages == ["code2wav"]
    make = Token2WavParams if generation else SamplingParams
    try:
        pipe = OmniJaxPipeline.from_pretrained(model_dir, mesh=spec["mesh"], stages=stages, **engine)
        prompts = spec.get("prompts_of", {}).get(me, spec["prompts"])
        if spec.get("warmup"):
            pipe.warmup(progress=False)
        with CompileCounter() as counted:
            outs = pipe.run(prompts, [make(**p) for p in spec["params"]], progress=False)
    except ValueError as e:
        with open(out_json, "w") as f:
            json.dump({"error": str(e)}, f)
        return
    first = pipe.stages[0]
    if generation:
        mesh, kernel = first.runner.mesh, ("dit", "transformer_blocks", 0, "attn", "to_q", "kernel")
        state = first.runner.state
    else:
        mesh, kernel = first.engine.runner.mesh, ("model", "layers", 0, "self_attn", "q_proj", "kernel")
        state = first.engine.runner.state
    q = dict(nnx.to_flat_state(state))[kernel].get_value()
    result = {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "global_devices": jax.device_count(),
        "mesh_processes": sorted({d.process_index for d in mesh.devices.flat}),
        "q_local_shards": [list(s.data.shape) for s in q.addressable_shards],
        "token_ids": [o.token_ids for o in outs],
        "audio": [o.audio.tolist() for o in outs if o.audio is not None],
        "compiles_after_warmup": counted.compiles if spec.get("warmup") else None,
    }
    with open(out_json, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
