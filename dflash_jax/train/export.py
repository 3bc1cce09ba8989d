"""Writes trained weights in the HuggingFace release layouts, so a trained pair goes through `convert-weights`
exactly like a downloaded one, and transformers / the z-lab reference can load it. Each family's writer lives in
its package (`dflash_jax/models/<family>/hf.py`) and is found through the registry: `save_hf_target` by the
config's target family (`ModelFamily.export_hf`), `save_hf_draft` by the draft family."""

from __future__ import annotations

from dflash_jax.models.family import draft_family, families, family_of


def save_hf_target(weights, cfg, directory: str, *, eos_token_id=None) -> None:
    """Writes `weights` of any family that registers a writer (`ModelFamily.export_hf`)."""
    fam = family_of(cfg)
    if fam.export_hf is None:
        known = sorted(f.name for f in families() if f.export_hf is not None)
        raise ValueError(f"export writes {', '.join(known)} targets, not {fam.name}")
    fam.export_hf(weights, cfg, directory, eos_token_id=eos_token_id)


def save_hf_draft(weights, cfg, directory: str) -> None:
    """The z-lab draft layout: `DFlashDraftModel`, or `DFlash2DraftModel` for a DFlash 2 draft
    (`dflash_jax.models.draft.hf.export_hf`), as `convert.draft` reads it."""
    draft_family().export_hf(weights, cfg, directory)
