"""The tree build's acceptance model as a file (host side): `save_calibration` writes a fitted
`spec.tree.TreeCalibration` as a small JSON file carrying a sha256 of its content and the pair's fingerprint;
`load_calibration` reads one back, checked (structure, checksum, pair); `pair_calibration` is the one shipped beside
a pair's checkpoint (`CALIBRATION_FILE`), which `spec.loop.generate_tree` builds from by default. The fitting
itself is research code (`study.tree_calibration`)."""

from __future__ import annotations

import functools
import hashlib
import json
import os

import numpy as np

from dflash_jax.errors import CheckpointError, open_regular
from dflash_jax.pair import pair_fingerprint
from dflash_jax.spec.tree import CALIBRATION_FEATURES, TreeCalibration

CALIBRATION_FILE = "tree_calibration.json"  # a pair's shipped acceptance model, beside its checkpoint
CALIBRATION_FORMAT = "dflash_jax.tree_calibration/1"


def calibration_digest(body: dict) -> str:
    """The sha256 a calibration file carries of its own fitted content (format, features, weights, pair)."""
    keep = {k: body[k] for k in ("format", "features", "weights", "pair_fingerprint")}
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()


def save_calibration(cal: "TreeCalibration", path: str, *, pair=None, fitted_on: dict | None = None) -> str:
    """Writes `cal` as a small JSON file (its weights, the feature names, what it was fitted on, the pair's
    fingerprint and a sha256 over them); `path` a file or a pair's directory (then `CALIBRATION_FILE` in it).
    Written to a temporary file beside it and renamed: no half-written file is left. Returns the file's path."""
    if os.path.isdir(path):
        path = os.path.join(path, CALIBRATION_FILE)
    body = dict(format=CALIBRATION_FORMAT, features=list(CALIBRATION_FEATURES), weights=list(cal.weights),
                pair_fingerprint=None if pair is None else pair_fingerprint(pair), fitted_on=fitted_on or {})
    body["sha256"] = calibration_digest(body)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as fh:
            json.dump(body, fh, indent=1)
            fh.write("\n")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


_CALIBRATION_FIX = ("refit it (benchmarks/tree.py --fit-calibration, or study.tree_calibration.fit_calibration "
                    "+ save_calibration), or delete the file (trees then build from the draft's distributions)")
_CALIBRATION_MAX_BYTES = 1 << 20  # a calibration file is about 1 KB
_HEX64 = frozenset("0123456789abcdef")


def _is_digest(value) -> bool:
    return isinstance(value, str) and len(value) == 64 and set(value) <= _HEX64


def load_calibration(path: str, pair=None) -> "TreeCalibration":
    """A `TreeCalibration` from `save_calibration`'s file, its structure (every field, its type and range)
    and checksum checked, and with `pair` the pair's fingerprint (a calibration fitted for another target or
    draft is refused). Anything wrong raises CheckpointError (a ValueError) naming the file and the fix; the
    file is opened non-blocking and must be a regular file (a FIFO is refused, never read)."""
    path = os.fspath(path)
    try:
        st = os.stat(path)
        stamp = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)  # a rewritten file is read again
    except OSError:
        stamp = None
    return _load_calibration(path, None if pair is None else pair_fingerprint(pair), stamp)


@functools.lru_cache(maxsize=8)
def _load_calibration(path: str, fingerprint: str | None, stamp) -> "TreeCalibration":
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"tree calibration {path} {why}: {_CALIBRATION_FIX}")

    try:
        with open_regular(path, CheckpointError, what="tree calibration file (JSON)",
                          fix=f"put the real file there, or {_CALIBRATION_FIX}") as fh:
            raw = fh.read(_CALIBRATION_MAX_BYTES + 1)
    except OSError as e:
        raise bad(f"cannot be read ({e.strerror or e})") from None
    if len(raw) > _CALIBRATION_MAX_BYTES:
        raise bad(f"is larger than {_CALIBRATION_MAX_BYTES} bytes (a calibration file is about 1 KB)")
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise bad("cannot be read (it is not UTF-8 text)") from None
    except ValueError as e:
        raise bad(f"cannot be read (it is not valid JSON: {e})") from None
    if not isinstance(body, dict) or body.get("format") != CALIBRATION_FORMAT:
        got = body.get("format") if isinstance(body, dict) else f"a JSON {type(body).__name__}"
        raise bad(f"is not a {CALIBRATION_FORMAT} file (format: {got!r})")
    missing = [k for k in ("features", "weights", "pair_fingerprint", "sha256") if k not in body]
    if missing:
        raise bad(f"lacks the field{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))}")
    features, weights = body["features"], body["weights"]
    if not isinstance(features, list) or not all(isinstance(f, str) for f in features):
        raise bad(f"has 'features' {features!r}, not a list of feature names")
    n = len(CALIBRATION_FEATURES)
    numbers = isinstance(weights, list) and all(
        isinstance(w, (int, float)) and not isinstance(w, bool) and np.isfinite(w) and abs(w) <= 1e6 for w in weights)
    if not numbers or len(weights) != n:
        raise bad(f"has 'weights' {str(weights)[:80]!s}, not a list of {n} finite numbers (one per feature, "
                  f"|w| <= 1e6)")
    if body["pair_fingerprint"] is not None and not _is_digest(body["pair_fingerprint"]):
        raise bad(f"has 'pair_fingerprint' {str(body['pair_fingerprint'])[:80]!r}, not null or a sha256 hex digest")
    if "fitted_on" in body and not isinstance(body["fitted_on"], dict):
        raise bad(f"has 'fitted_on' {str(body['fitted_on'])[:80]!r}, not a JSON object")
    if not _is_digest(body["sha256"]) or body["sha256"] != calibration_digest(body):
        raise bad("fails its sha256 (edited or truncated)")
    if features != list(CALIBRATION_FEATURES):
        raise bad(f"has features {features}, this version uses {list(CALIBRATION_FEATURES)}")
    stored = body["pair_fingerprint"]
    if fingerprint is not None and stored not in (None, fingerprint):
        raise bad(f"was fitted for another target/draft (fingerprint {stored[:12]} vs the pair's {fingerprint[:12]})")
    return TreeCalibration(tuple(float(w) for w in weights))


def pair_calibration(pair) -> "TreeCalibration | None":
    """The acceptance model shipped beside the pair's checkpoint (`CALIBRATION_FILE`, checked by
    `load_calibration` against the pair), or None (the plain build) when the pair has none. `generate_tree`
    builds from it by default."""
    directory = getattr(pair, "directory", None)
    if not directory or not os.path.exists(os.path.join(directory, CALIBRATION_FILE)):
        return None
    return load_calibration(os.path.join(directory, CALIBRATION_FILE), pair)
