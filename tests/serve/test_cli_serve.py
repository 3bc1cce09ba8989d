"""`dflash-serve`: flag errors end in one line before anything heavy loads; a real process serves the `openai`
client and shuts down gracefully on SIGTERM (slow)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dflash_jax.cli.serve import main
from tests.serve.server_process import free_port, stop, wait_ready


@pytest.mark.parametrize("argv, message", [
    (["--checkpoint", "/definitely/not/here"], "not a convert-weights checkpoint"),
    (["--port", "70000"], "--port must be in 0..65535"),
    (["--slots", "0"], "--slots must be >= 1"),
    (["--round-expert-mb", "-1"], "--round-expert-mb must be > 0"),
    (["--token-budget", "0"], "--token-budget must be >= 1"),
    (["--widths", "1,x"], "--widths must be 'auto', 'fixed' or a comma list"),
    (["--widths", "0,4"], "--widths must be positive integers"),
    (["--widths", "1,C"], "B: the block size"),
    (["--proposer", "tree", "--widths", "1,B"], "chooses chain widths"),
])
def test_flag_errors_are_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dflash-serve: error:") and message in err and "\n" not in err


def test_help_names_the_flags(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--checkpoint", "--slots", "--block-size", "--max-prompt-len", "--max-new-tokens", "--max-queue",
                 "--token-budget", "--round-expert-mb", "--grace-seconds", "--widths"):
        assert flag in out


@pytest.mark.slow
def test_process_serves_and_stops_on_sigterm(tmp_path):
    openai = pytest.importorskip("openai")
    port = free_port()
    env = dict(os.environ, DFLASH_JAX_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.Popen([sys.executable, "-m", "dflash_jax.cli.serve", "--port", str(port), "--slots", "2",
                             "--max-prompt-len", "16", "--max-new-tokens", "16", "--log-level", "warning"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        models = wait_ready(client, proc)
        assert [m.id for m in models.data] == ["tiny_pair"]
        out = client.completions.create(model="tiny_pair", prompt="def fib(n):", max_tokens=8, temperature=0)
        assert out.usage.completion_tokens >= 1 and out.choices[0].finish_reason in ("stop", "length")
    finally:
        code = stop(proc)
    err = proc.stderr.read()
    assert code == 128 + 15, err
    assert "ready in" in err and "stopped (SIGTERM)" in err and "Traceback" not in err


def test_default_chooses_width_1_or_a_block_of_4_and_auto_chooses_up_to_the_drafts_block():
    """`dflash-serve` with no width flags chooses each round between no speculation and a block of 4 (width 1 or 4,
    docs/serving.md "Which default"); `--widths fixed` verifies the block every round; `--widths auto` chooses from
    1, 2, 4, .. up to the draft's trained block; an explicit --block-size wins, and B in a list stands for it."""
    from dflash_jax.cli.serve import DEFAULT_FIXED_BLOCK, build_app, build_parser

    parse = build_parser().parse_args
    base = ["--no-warmup", "--slots", "1", "--max-prompt-len", "16"]
    _, engine = build_app(parse(base))
    assert engine.widths == (1, DEFAULT_FIXED_BLOCK) == (1, 4) and engine.spec.block_size == 4
    assert engine.acceptance_exploration  # on by default, off with its flag
    _, engine = build_app(parse(base + ["--no-acceptance-exploration"]))
    assert not engine.acceptance_exploration and engine.widths == (1, 4)
    assert not engine.greedy_programs  # a CPU: one program ("auto")
    _, engine = build_app(parse(base + ["--greedy-programs", "on"]))
    assert engine.greedy_programs
    _, engine = build_app(parse(base + ["--greedy-programs", "off"]))
    assert not engine.greedy_programs
    _, engine = build_app(parse(base + ["--widths", "fixed"]))
    assert engine.widths == (4,) and engine.spec.block_size == 4
    block = engine.pair.draft_cfg.block_size
    _, engine = build_app(parse(base + ["--widths", "auto"]))
    assert engine.widths[0] == 1 and engine.widths[-1] == block > 4
    _, engine = build_app(parse(base + ["--block-size", "8"]))
    assert engine.widths == (1, 8) and engine.spec.block_size == 8
    _, engine = build_app(parse(base + ["--block-size", "8", "--widths", "2,B"]))
    assert engine.widths == (2, 8)
    _, engine = build_app(parse(base + ["--block-size", "1"]))
    assert engine.widths == (1,) and not engine.defer_context  # no speculation: one width, nothing held


def test_experts_load_as_dflash_generate_loads_them():
    """On the CPU (no FP4 kernel) `dflash-serve` dequantizes the FP4 expert tables once at load, as
    `dflash-generate` does, instead of every round dequantizing every table (2.7x a 32-row round's time on the
    shipped pair); `--dequantize-experts no` serves them as stored, and `yes` is refused with offloaded experts."""
    import pytest

    from dflash_jax.cli.serve import build_app, build_parser, check_args
    from dflash_jax.errors import UsageError
    from pallas_kernels.ops import is_fp4

    parse = build_parser().parse_args
    base = ["--no-warmup", "--slots", "1", "--max-prompt-len", "16", "--block-size", "1"]
    tables = lambda engine: [engine.pair.target.layers[0].mlp.gate_up, engine.pair.target.layers[0].mlp.down]
    _, engine = build_app(parse(base))
    assert not any(is_fp4(t) for t in tables(engine))
    _, engine = build_app(parse(base + ["--dequantize-experts", "no"]))
    assert all(is_fp4(t) for t in tables(engine))
    with pytest.raises(UsageError, match="--dequantize-experts yes does not combine with --experts offload"):
        check_args(parse(base + ["--dequantize-experts", "yes", "--experts", "offload", "--expert-budget-mb", "1"]))


def test_a_checkpoints_hostile_chat_template_is_refused_at_start_and_never_runs(tmp_path, capsys):
    """The reproduction: the shipped pair with a tokenizer_config.json whose chat template reaches Python's `os`.
    Recorded in the checksums (as its publisher would ship it), `dflash-serve` refuses it in one line before
    warming up and the file the template would create never appears; edited after conversion, it fails the
    checksum at load."""
    import json
    import shutil

    from dflash_jax import SHIPPED_PAIR
    from dflash_jax.checkpoint import add_side_file

    ckpt = tmp_path / "pair"
    shutil.copytree(SHIPPED_PAIR, ckpt)
    pwned = tmp_path / "PWNED"
    template = ("{{ cycler.__init__.__globals__.os.popen('touch " + str(pwned) + "').read() }}"
                "{% for m in messages %}{{ m.content }}{% endfor %}")
    (ckpt / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    argv = ["--checkpoint", str(ckpt), "--no-warmup", "--no-compile-cache", "--slots", "1", "--max-prompt-len", "16"]
    assert main(argv) == 2  # not in the checksums: refused as added after conversion
    err = capsys.readouterr().err.strip()
    assert "tokenizer_config.json" in err and "\n" not in err, err
    add_side_file(str(ckpt), "tokenizer_config.json")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "Python internals" in err and "\n" not in err and "compiling" not in err, err
    (ckpt / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    assert main(argv) == 2  # edited after it was recorded: the checksum fails
    err = capsys.readouterr().err.strip()
    assert "tokenizer_config.json" in err and "\n" not in err, err
    assert not pwned.exists()
