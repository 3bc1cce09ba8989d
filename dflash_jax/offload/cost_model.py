"""Moved. The cost model (tables of real models and machines, B0-B3 estimates) is study code:
`dflash_jax.study.cost_model`. The runtime's bandwidth probe is `offload.bandwidth`.

TODO(loop-api): this name stays only for `offload/loop.py`'s import of the probe; delete it once the loop
imports `dflash_jax.offload.bandwidth`.
"""

from dflash_jax.offload.bandwidth import probe_host_to_device_bandwidth  # noqa: F401
