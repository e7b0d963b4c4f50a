"""One process of ``test_two_processes.py``: joins the run through the environment, writes JSON.

Started as ``python tests/two_process_worker.py MODEL_DIR PROMPTS_JSON OUT_JSON`` with
``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` set, exactly as a
user would start each host.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("OMNI_JAX_COMPILATION_CACHE", "0")


def main(model_dir: str, prompts_json: str, out_json: str) -> None:
    import jax
    from flax import nnx

    from omni_jax import OmniJaxPipeline, SamplingParams

    spec = json.loads(open(prompts_json).read())
    pipe = OmniJaxPipeline.from_pretrained(model_dir, mesh=spec["mesh"], **spec["engine"])
    params = [SamplingParams(**p) for p in spec["params"]]
    outs = pipe.run(spec["prompts"], params, progress=False)
    runner = pipe.stages[0].engine.runner
    q = dict(nnx.to_flat_state(runner.state))[
        ("model", "layers", 0, "self_attn", "q_proj", "kernel")
    ].get_value()
    result = {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "global_devices": jax.device_count(),
        "mesh_processes": sorted({d.process_index for d in runner.mesh.devices.flat}),
        "q_local_shards": [list(s.data.shape) for s in q.addressable_shards],
        "token_ids": [o.token_ids for o in outs],
    }
    with open(out_json, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
