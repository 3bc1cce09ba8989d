"""The parts of a decoder forward that do not depend on the family: positions of a block written at the
cache lengths, the DFlash taps `h[i+1]`, and the logits modes ("all" / "last" / "none")."""

from __future__ import annotations

from typing import Callable, Literal, Sequence

import jax
import jax.numpy as jnp

LogitsMode = Literal["all", "last", "none"]


def block_positions(starts: jax.Array, width: int) -> jax.Array:
    """[b, T] absolute positions of a block of `width` tokens written at each sequence's length `starts`."""
    return starts[:, None] + jnp.arange(width, dtype=jnp.int32)


def layer_taps(layer_outputs: Sequence[jax.Array], normed_final: jax.Array, tap_layers: tuple[int, ...]):
    """`h[i+1]` for each i in `tap_layers`: the output of layer i, except for the last layer, whose entry is
    taken after the final norm (HF `output_hidden_states` convention, which the DFlash drafts were trained
    on)."""
    last = len(layer_outputs) - 1
    return tuple(normed_final if i == last else layer_outputs[i] for i in tap_layers)


def select_logits(
    normed: jax.Array, num_valid: jax.Array, mode: LogitsMode, head: Callable[[jax.Array], jax.Array]
) -> jax.Array | None:
    """Logits of final-normed hidden states [b, T, H]: every row ("all"), each sequence's last valid row
    ("last", [b, V]) or none."""
    if mode == "all":
        return head(normed)
    if mode == "last":
        b, t = normed.shape[:2]
        idx = jnp.clip(num_valid - 1, 0, t - 1)
        return head(normed[jnp.arange(b), idx])
    if mode == "none":
        return None
    raise ValueError(f"logits must be 'all', 'last' or 'none', got {mode!r}")
