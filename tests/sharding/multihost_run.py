"""One process of a multi-host speculative run on CPU devices (run by tests/sharding/test_sharding.py).

  python multihost_run.py PORT NUM_PROCESSES PROCESS_ID DEVICES_PER_PROCESS MESH OUT_JSON FAMILY

Every process runs this same program (`jax.distributed.initialize` with a coordinator on 127.0.0.1): the
same random pair, placed on one mesh over all processes' devices, generated from the same prompts. Process
0 writes the generated tokens (greedy and sampled) to OUT_JSON.
"""

from __future__ import annotations

import json
import os
import sys


def main(argv: list[str]) -> None:
    port, nproc, pid, ndev, mesh_spec, out_path, family = argv
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={int(ndev)}"
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=int(nproc),
                               process_id=int(pid))
    from mesh_checks import CASE_PROMPTS, case_pair, run_case  # the same pair and requests as the 1-process checks

    from dflash_jax.sharding import make_mesh

    assert jax.process_count() == int(nproc) and len(jax.devices()) == int(nproc) * int(ndev)
    mesh = make_mesh(mesh_spec)
    assert len({d.process_index for d in mesh.devices.flat}) == int(nproc), "the mesh must span every process"
    result = run_case(case_pair(family), mesh, CASE_PROMPTS)
    if jax.process_index() == 0:
        with open(out_path, "w") as fh:
            json.dump(result, fh)
    jax.distributed.shutdown()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main(sys.argv[1:])
