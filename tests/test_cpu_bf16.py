"""bf16 on CPU runs on XLA:CPU's bf16 kernels: no step converts a whole weight matrix or KV cache to
float32 (which every step did, ~10x slower than float32; `layers.project`, `cache.storage_dtype`).

A slow path here changes no output, only the time, and timings are not asserted; so the compiled
programs are read instead: a float32 array of a weight's or a cache's shape in a bf16 step is such
a conversion."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bastion_jax.checkpoints import load_target, random_drafter
from bastion_jax.engine import Engine
from bastion_jax.modeling.cache import KVCache, storage_dtype
from bastion_jax.modeling.layers import project
from bastion_jax.testing import tiny_drafter_config
from bastion_jax.tree_decoding import DRAFT, HOLD

BLOCK = 4
pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's kernels")


def _arrays(hlo: str, dtype: str) -> set[tuple[int, ...]]:
    """Shapes of the `dtype` arrays a compiled program materialises: the results of the instructions
    outside fusion bodies (inside one, a convert is computed per output element, never stored)."""
    fused = set(re.findall(r"calls=(%[\w.\-]+)", hlo))
    shapes, inside = set(), False
    for line in hlo.splitlines():
        head = re.match(r"(?:ENTRY )?(%[\w.\-]+) .*\{$", line)
        if head:
            inside = head.group(1) in fused
        elif not inside:
            m = re.match(rf"\s+(?:ROOT )?%\S+ = {dtype}\[([\d,]+)\]", line)
            if m:
                shapes.add(tuple(int(d) for d in m.group(1).split(",")))
    return shapes


def test_bf16_steps_convert_no_weight_or_cache_to_float32(converted):
    _, f32_target = converted("qwen3")
    target = load_target(f32_target.path, jnp.bfloat16)
    drafter = random_drafter(tiny_drafter_config(target.config, num_layers=1, block_size=BLOCK), target.dtype)
    engine = Engine(target, stop_ids=[], drafter=drafter, buckets=(1, 4), top_k=2)
    exe, cache_len = engine.executables, 512
    steps = {"decode": exe.ar(1, 16, cache_len)[1]}
    _, trees = exe.tree(1, 16, cache_len, (4,))
    roots = exe.roots(1, cache_len)
    steps.update(tree_step4=trees[4].exe, root_hold=roots[HOLD].exe, root_draft=roots[DRAFT].exe)
    weights = {tuple(x.shape) for st in (target.state, drafter.state) for x in jax.tree.leaves(st) if x.ndim == 2}
    cache = KVCache.create(target.config, 1, cache_len, target.dtype)
    assert cache.k.dtype == jnp.float32  # held in float32 on CPU: the same values
    for name, step in steps.items():
        hlo = step.as_text()
        assert _arrays(hlo, "bf16") and _arrays(hlo, "f32")  # the reading of the program works
        found = _arrays(hlo, "f32") & weights
        assert not found, f"{name} converts bf16 weights of shapes {sorted(found)} to float32"
        found = _arrays(hlo, "bf16") & {tuple(cache.k.shape), tuple(cache.k.shape[1:])}
        assert not found, f"{name} converts its float32 cache to bf16 (shapes {sorted(found)})"


def test_bf16_caches_are_held_in_float32_on_cpu_only():
    assert storage_dtype(jnp.bfloat16) == jnp.float32 and storage_dtype(jnp.float16) == jnp.float32
    assert storage_dtype(jnp.float32) == jnp.float32


@pytest.mark.parametrize("rows", [(1, 1), (1, 3), (2, 3)])
def test_bf16_project_is_the_float32_accumulated_product_rounded_once(rows):
    """One row (padded to two inside) or several: each row's product equals the same row's product
    in a larger batch, and the float32-accumulated product of the bf16 values, rounded once."""
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.normal(size=(48, 32)), jnp.bfloat16)  # [out, in]
    x = jnp.asarray(rng.normal(size=rows + (32,)), jnp.bfloat16)
    y = jax.jit(lambda x, w: project("...i,oi->...o", x, w))(x, w)
    assert y.dtype == jnp.bfloat16 and y.shape == rows + (48,)
    exact = (np.asarray(x, np.float64) @ np.asarray(w, np.float64).T).astype(np.float32)
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(jnp.asarray(exact).astype(jnp.bfloat16),
                                                                    np.float32), rtol=1e-2, atol=1e-2)
    wide = jax.jit(lambda x, w: project("...i,oi->...o", x, w))(jnp.concatenate([x.reshape(-1, 32)] * 3), w)
    np.testing.assert_array_equal(np.asarray(wide[: int(np.prod(rows))], np.float32),
                                  np.asarray(y.reshape(-1, 48), np.float32))
    logits = jax.jit(lambda x, w: project("...i,oi->...o", x, w, jnp.float32))(x, w)
    assert logits.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(logits), exact, rtol=1e-5, atol=1e-4)


def test_a_float32_cache_of_bf16_values_attends_as_the_bf16_cache():
    """A bf16 model's cache held in float32 changes no attention output: the prefix part and the
    fresh keys round their probabilities alike (to the queries' dtype). Rounded only in the fresh
    part, AR steps (whose previous token is a cached key) and trees (where it is a fresh one) parted
    by ~0.2 of a logit on SmolLM2 and greedy output left AR at no tie."""
    from bastion_jax.modeling.attention import attend_split

    rng = np.random.default_rng(2)
    b, max_len, t, hq, hkv, d = 1, 600, 3, 4, 2, 16
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
    q = bf(rng.normal(size=(b, t, hq, d)))
    k_cache, v_cache = bf(rng.normal(size=(b, hkv, max_len, d)) * 3), bf(rng.normal(size=(b, hkv, max_len, d)))
    k_new, v_new = bf(rng.normal(size=(b, t, hkv, d)) * 3), bf(rng.normal(size=(b, t, hkv, d)))
    mask = jnp.asarray(np.tril(np.ones((t, t), bool))[None])
    length = jnp.asarray([500], jnp.int32)  # several trips of the prefix loop
    run = jax.jit(lambda kc, vc: attend_split(q, kc, vc, length, k_new, v_new, mask))
    want = run(k_cache, v_cache)
    got = run(k_cache.astype(jnp.float32), v_cache.astype(jnp.float32))
    assert got.dtype == want.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
