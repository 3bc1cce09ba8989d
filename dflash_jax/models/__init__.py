"""Model families. Importing this package registers the built-in target families (`models.family`)."""

from dflash_jax.models import draft, gpt_oss, qwen3, qwen3_5  # noqa: F401  (registration on import)
from dflash_jax.models.family import (  # noqa: F401
    ModelFamily, families, family_named, family_of, family_of_weights, is_moe_layer, register,
)
