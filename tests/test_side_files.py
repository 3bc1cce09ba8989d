"""dflash-generate with a damaged file beside the checkpoint's weights (the branch head, the tree calibration):
one line naming the file and the fix, exit 2; never a hang (a FIFO is refused, not read) nor a traceback."""

from __future__ import annotations

import json
import os
import shutil
import threading

import dflash_jax
from dflash_jax.cli.generate import main
from dflash_jax.pair import BRANCH_HEAD_FILE
from dflash_jax.spec.calibration_file import CALIBRATION_FILE


def _copy(tmp_path):
    out = tmp_path / "pair"
    shutil.copytree(dflash_jax.SHIPPED_PAIR, out)
    return out


def _run(capsys, *argv, timeout=120.0):
    """main(argv) in a thread: a run that blocks fails the test instead of hanging it."""
    out = {}
    t = threading.Thread(target=lambda: out.update(code=main([str(a) for a in argv])), daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"dflash-generate {' '.join(map(str, argv))} blocked"
    return out.get("code"), capsys.readouterr().err.strip().splitlines()


def test_a_fifo_branch_head_is_never_read_and_fails_in_one_line_when_a_tree_needs_it(tmp_path, capsys):
    """Without tree flags the branch head is not read at all (the run generates); a tree that needs it gets one
    line naming the FIFO, never a hang."""
    pair = _copy(tmp_path)
    os.remove(pair / BRANCH_HEAD_FILE)
    os.mkfifo(pair / BRANCH_HEAD_FILE)
    code, err = _run(capsys, "--checkpoint", pair, "--prompt-ids", "1,2,3", "--max-new-tokens", 2)
    assert code == 0, err
    code, err = _run(capsys, "--checkpoint", pair, "--prompt-ids", "1,2,3", "--max-new-tokens", 2, "--tree-budget", 4)
    assert code == 2 and len(err) == 1, err
    assert f"{pair / BRANCH_HEAD_FILE} is a FIFO (named pipe)" in err[0] and "refit it" in err[0], err


def test_a_calibration_without_weights_fails_in_one_line(tmp_path, capsys):
    pair = _copy(tmp_path)
    body = json.loads((pair / CALIBRATION_FILE).read_text())
    del body["weights"]
    (pair / CALIBRATION_FILE).write_text(json.dumps(body))
    code, err = _run(capsys, "--checkpoint", pair, "--prompt-ids", "1,2,3", "--max-new-tokens", 2, "--tree-budget", 4)
    assert code == 2 and len(err) == 1, err
    assert str(pair / CALIBRATION_FILE) in err[0] and "lacks the field 'weights'" in err[0], err
    assert "refit it" in err[0] and "delete the file" in err[0]
