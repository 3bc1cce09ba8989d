"""`dflash-serve`'s capacity defaults (`serve.capacity`): the slots and the prompt length the memory budget holds for
the pair, computed from the cache shapes (nothing allocated), printed in one line; explicit flags kept and checked
(one error each). Shapes only: no warm-up."""

from __future__ import annotations

import pytest

from dflash_jax.serve import capacity

MB = 10**6


def budget(mb: float, cpu: bool = False, cores: int = 2) -> capacity.Budget:
    return capacity.Budget(bytes=int(mb * MB), source=f"a {mb:g} MB test budget", cpu=cpu, cores=cores)


def test_slot_cost_follows_the_cache_shapes(pair):
    from dflash_jax.models import draft as draft_model
    from dflash_jax.spec.session import init_target_cache

    t, d = capacity.row_bytes(pair, 512, 4, 256)
    tcfg, dcfg = pair.target_cfg, pair.draft_cfg
    # a KV buffer pair per layer, [1, 512, kv heads, head dim] of the weights' dtype
    item = pair.target.embed.dtype.itemsize
    assert t == 2 * tcfg.num_layers * 512 * tcfg.num_kv_heads * tcfg.head_dim * item + 4  # + the lengths
    assert d == 2 * dcfg.num_layers * 512 * dcfg.num_kv_heads * dcfg.head_dim * item + 4 + 4 * 256
    real = init_target_cache(tcfg, 1, 512, pair.target.embed.dtype, verify_width=4)
    assert t == sum(x.nbytes for x in __import__("jax").tree.leaves(real))
    assert capacity.row_bytes(pair, 1024, 4, 256)[0] > t  # rows grow with the cache length
    del draft_model


def test_defaults_fill_the_budget_and_say_how(pair):
    plan = capacity.plan(pair, widest=16, max_new_tokens=256, budget=budget(400))
    ctx = pair.target_cfg.max_position_embeddings
    assert plan.max_prompt_len == ctx - 1 - 16 and plan.max_len == ctx  # prompts up to the context
    assert plan.slots >= capacity.MIN_SLOTS and plan.used_bytes <= 400 * MB
    assert plan.used_bytes + plan.slot_bytes > 400 * MB or plan.slots == plan.cap  # one more would not fit
    line = plan.describe()
    assert "\n" not in line and f"{plan.slots} slots" in line and "a 400 MB test budget" in line
    assert "the target's context" in line and "as many as fit" in line
    # a small budget shortens the prompts (halving) until MIN_SLOTS fit
    small = capacity.plan(pair, widest=16, max_new_tokens=256, budget=budget(60))
    assert small.max_prompt_len < plan.max_prompt_len and small.slots >= capacity.MIN_SLOTS and small.halved
    assert "halved" in small.describe()
    # the prefix cache's pool and an offloaded engine's expert cache come out of the same budget
    pooled = capacity.plan(pair, widest=16, max_new_tokens=256, budget=budget(400), prefix_cache_bytes=200 * MB,
                           expert_cache_bytes=50 * MB)
    assert pooled.slots < plan.slots and pooled.used_bytes <= 400 * MB


def test_cpu_caps_slots_per_core(pair):
    plan = capacity.plan(pair, widest=4, max_new_tokens=64, max_prompt_len=64, budget=budget(10_000, cpu=True, cores=2))
    assert plan.slots == plan.cap == 2 * capacity.CPU_SLOTS_PER_CORE
    assert "at most 16" in plan.describe()
    gpu = capacity.plan(pair, widest=4, max_new_tokens=64, max_prompt_len=64, budget=budget(100_000))
    assert gpu.slots == capacity.MAX_SLOTS


def test_explicit_flags_are_kept_or_refused_in_one_line(pair):
    given = capacity.plan(pair, widest=16, max_new_tokens=256, budget=budget(400), slots=3)
    assert given.slots == 3 and given.max_prompt_len == pair.target_cfg.max_position_embeddings - 17
    assert "--slots" in given.describe()
    fitted = capacity.plan(pair, widest=16, max_new_tokens=256, budget=budget(400), max_prompt_len=100)
    assert fitted.max_prompt_len == 100 and fitted.max_len < 4096 and fitted.slots == capacity.MAX_SLOTS or \
        fitted.used_bytes + fitted.slot_bytes > 400 * MB
    with pytest.raises(capacity.CapacityError, match=r"--slots 200 with --max-prompt-len 4000 does not fit.*lower"):
        capacity.plan(pair, widest=16, max_new_tokens=256, budget=budget(400), slots=200, max_prompt_len=4000)
    with pytest.raises(capacity.CapacityError, match="does not fit one slot"):
        capacity.plan(pair, widest=16, max_new_tokens=256, budget=budget(1), max_prompt_len=4000)
    with pytest.raises(capacity.CapacityError, match="--slots 500 does not fit"):
        capacity.plan(pair, widest=16, max_new_tokens=256, budget=budget(400), slots=500)


def test_the_cli_fits_and_prints_the_line(capsys):
    from dflash_jax.cli.serve import build_app, build_parser, main

    _, engine = build_app(build_parser().parse_args(["--no-warmup", "--max-prompt-len", "16"]))
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if "capacity:" in x)
    assert f"{engine.slots} slots" in line and engine.slots >= 1 and "--max-prompt-len" in line
    assert engine.row_buckets[-1] == engine.slots  # every row bucket up to it is compiled at warm-up
    assert main(["--slots", "100000", "--max-prompt-len", "4000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("dflash-serve: error: --slots 100000 with --max-prompt-len 4000 does not fit")
