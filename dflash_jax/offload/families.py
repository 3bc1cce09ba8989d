"""Expert offload asks the model-family registry (`dflash_jax.models.family`) for everything it needs to
know about a target family; these names remain for callers of the offload package."""

from dflash_jax.models.family import ModelFamily as Family  # noqa: F401
from dflash_jax.models.family import families, family_of, family_of_weights, is_moe_layer  # noqa: F401

family_of_config = family_of
