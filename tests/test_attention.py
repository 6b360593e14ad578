"""Split attention (live prefix + new part, merged by log-sum-exp) against brute force.

The reference writes the new keys into the cache and runs one dense softmax over every cache slot
with a mask built slot by slot in NumPy: committed slots visible, stale slots past the live
length hidden, tree slots visible exactly where a node's ancestor (or itself) sits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bastion_jax.modeling.attention import Causal, attend, attend_split
from bastion_jax.modeling.cache import causal_mask, write_rows
from bastion_jax.tree import ancestor_mask


def random_tree_parents(rng, n: int) -> np.ndarray:
    """parents[0] = -1; every other node hangs under an earlier one."""
    return np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)], np.int32)


def dense_mask(lengths: np.ndarray, new_mask: np.ndarray, max_len: int) -> np.ndarray:
    """[b, t, max_len]: slot s visible to query i of row b when s < length, or s = length + j with
    new_mask[b, i, j]. Built with Python loops, independent of the code under test."""
    b, t, t_k = new_mask.shape
    out = np.zeros((b, t, max_len), bool)
    for r in range(b):
        for i in range(t):
            for s in range(max_len):
                j = s - lengths[r]
                out[r, i, s] = s < lengths[r] or (0 <= j < t_k and new_mask[r, i, j])
    return out


def heads_first(*caches: jax.Array) -> list[jax.Array]:
    """[b, max_len, kv, d] (the dense reference's keys, written by `write_rows`) -> the cache's
    layout [b, kv, max_len, d]."""
    return [c.swapaxes(1, 2) for c in caches]


def check(rng, *, b, max_len, lengths, new_mask, hq=4, hkv=2, d=8, dtype=jnp.float32, tol=2e-5, **chunks):
    t, t_k = new_mask.shape[1:]
    q = jnp.asarray(rng.normal(size=(b, t, hq, d)), dtype)
    k_cache = jnp.asarray(rng.normal(size=(b, max_len, hkv, d)) * 3, dtype)  # garbage past the live length too
    v_cache = jnp.asarray(rng.normal(size=(b, max_len, hkv, d)), dtype)
    k_new = jnp.asarray(rng.normal(size=(b, t_k, hkv, d)) * 3, dtype)
    v_new = jnp.asarray(rng.normal(size=(b, t_k, hkv, d)), dtype)
    length = jnp.asarray(lengths, jnp.int32)
    got = attend_split(q, *heads_first(k_cache, v_cache), length, k_new, v_new, jnp.asarray(new_mask), **chunks)
    want = attend(q, write_rows(k_cache, k_new, length), write_rows(v_cache, v_new, length),
                  jnp.asarray(dense_mask(np.asarray(lengths), new_mask, max_len)))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)
    # The models' form: one layer (here 1, a traced index) of stacked caches [layers, b, kv, max_len, d],
    # read in place, the other layers holding other values.
    stacked = [jnp.stack([-c, c, c * 0 + 5]) for c in heads_first(k_cache, v_cache)]
    in_place = jax.jit(lambda i: attend_split(q, *stacked, length, k_new, v_new, jnp.asarray(new_mask), layer=i,
                                              **chunks))(jnp.int32(1))
    np.testing.assert_allclose(np.asarray(in_place, np.float32), np.asarray(got, np.float32), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("max_len,chunk", [(40, 8), (40, 16), (40, 64), (37, 7)])
def test_tree_attention_matches_dense_mask_over_the_whole_cache(max_len, chunk):
    """Tree verification: prefix read in chunks (the last chunk shifted back when max_len is not a
    multiple), tree part through the ancestor matrix."""
    rng = np.random.default_rng(max_len + chunk)
    n = 9
    lengths = np.array([0, 5, 17, max_len - n])  # empty prefix, short, mid, cache full
    ancestors = np.stack([np.asarray(ancestor_mask(jnp.asarray(random_tree_parents(rng, n)), n)) for _ in lengths])
    check(rng, b=len(lengths), max_len=max_len, lengths=lengths, new_mask=ancestors, prefix_chunk=chunk)


def test_causal_and_drafter_masks_match_dense():
    rng = np.random.default_rng(0)
    lengths = np.array([3, 30])
    check(rng, b=2, max_len=48, lengths=lengths, new_mask=np.asarray(causal_mask(2, 6)), prefix_chunk=8)
    # The drafter's shape: C new context rows (the first ctx_len real) then a bidirectional block of B.
    c, block, ctx_len = 5, 4, np.array([2, 5])
    mask = np.concatenate([np.broadcast_to((np.arange(c)[None] < ctx_len[:, None])[:, None], (2, block, c)),
                           np.ones((2, block, block), bool)], axis=-1)
    check(rng, b=2, max_len=48, lengths=lengths, new_mask=mask, prefix_chunk=16)


def test_long_new_part_is_folded_in_chunks():
    """A prefill longer than new_chunk walks its own keys in chunks (the last one shifted back)."""
    rng = np.random.default_rng(1)
    t = 45
    check(rng, b=2, max_len=64, lengths=np.array([0, 11]), new_mask=np.asarray(causal_mask(2, t)), new_chunk=8)
    check(rng, b=2, max_len=64, lengths=np.array([0, 7]), new_mask=np.asarray(causal_mask(2, 20)),
          new_chunk=6, prefix_chunk=5)


def test_bfloat16_close_to_dense():
    rng = np.random.default_rng(2)
    check(rng, b=2, max_len=40, lengths=np.array([4, 25]), new_mask=np.asarray(causal_mask(2, 5)),
          dtype=jnp.bfloat16, tol=3e-2, prefix_chunk=8)


def test_prefix_loop_stops_at_the_live_context():
    """Slots past max(length) are never read: poisoning them with NaN changes nothing."""
    rng = np.random.default_rng(3)
    b, max_len, t, hq, hkv, d = 2, 64, 3, 2, 1, 4
    q = jnp.asarray(rng.normal(size=(b, t, hq, d)), jnp.float32)
    k_cache = jnp.asarray(rng.normal(size=(b, max_len, hkv, d)), jnp.float32)
    v_cache = jnp.asarray(rng.normal(size=(b, max_len, hkv, d)), jnp.float32)
    k, v = k_cache[:, :t], v_cache[:, :t]
    length = jnp.asarray([5, 16], jnp.int32)
    mask = causal_mask(b, t)
    k_cache, v_cache = heads_first(k_cache, v_cache)
    clean = attend_split(q, k_cache, v_cache, length, k, v, mask, prefix_chunk=8)
    poisoned = attend_split(q, k_cache.at[:, :, 16:].set(jnp.nan), v_cache.at[:, :, 16:].set(jnp.nan), length, k, v,
                            mask, prefix_chunk=8)
    np.testing.assert_array_equal(np.asarray(clean), np.asarray(poisoned))
    assert np.isfinite(np.asarray(clean)).all()
    jitted = jax.jit(lambda kc, vc: attend_split(q, kc, vc, length, k, v, mask, prefix_chunk=8))
    np.testing.assert_allclose(np.asarray(jitted(k_cache, v_cache)), np.asarray(clean), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("scan", [False, True])  # per-layer caches, unrolled layers | a stacked cache, scanned
@pytest.mark.parametrize("slots", [56, 328])  # under one prefix trip (one read; CPU: 64-128) and over (the loop)
def test_compiled_steps_never_copy_a_cache_buffer(slots, scan):
    """Per step, only the new slots of a (donated) cache are written: no whole-buffer copy of any layer's
    K/V in the compiled AR, tree (incl. a root-only tree) and root steps. Regressions here cost a full
    cache read + write per layer per step (4.6x the AR step at an 8192-slot cache on CPU)."""
    import re

    from bastion_jax.executables import Executables
    from bastion_jax.presets import preset_configs, random_models
    from bastion_jax.checkpoints import layer_layout

    tcfg, dcfg = preset_configs("smollm2-135m", 2, 1, 4)
    target, drafter = random_models(layer_layout(tcfg, scan), dcfg, jnp.float32, 0)
    exe = Executables(target, drafter, proposal=None, block_size=4, mask_token_id=0, buckets=(1, 4), top_k=8,
                      draft_vocab=None)
    # (cache lengths no other array of these steps has)
    _, decode = exe.ar(1, 16, slots)
    _, steps = exe.tree(1, 16, slots, [1, 4])
    roots = exe.roots(1, slots)
    compiled = {"decode": decode, **{f"tree_step({b})": s.exe for b, s in steps.items()},
                **{f"root_step({t})": r.exe for t, r in roots.items()}}
    copy = re.compile(r"= \w+\[(\d+,)?1,\d+,%d,\d+\]\{[^}]*\} copy\(" % slots)  # ([layers,] 1, kv, slots, d)
    # The pattern finds a real copy: a donated cache updated in place while its old value is returned too.
    cache = jax.ShapeDtypeStruct((2, 1, 3, slots, 64), jnp.float32)
    keep_old = jax.jit(lambda c: (c.at[0, 0, 0, 0, 0].set(1.0), c), donate_argnums=0)
    assert copy.search(keep_old.lower(cache).compile().as_text())
    for name, exe_ in compiled.items():
        copies = [line.strip() for line in exe_.as_text().splitlines() if copy.search(line)]
        assert not copies, (name, copies[:2])


@pytest.mark.parametrize("t", [5, 19])
def test_nothing_committed_reads_no_prefix(t):
    """length None (a prefill, known at trace time) equals a zero length: the cache, full of garbage,
    is not read either way. Short and chunked new parts (new_chunk 8 < 19)."""
    rng = np.random.default_rng(t)
    b, max_len, hq, hkv, d = 2, 24, 4, 2, 8
    q = jnp.asarray(rng.normal(size=(b, t, hq, d)), jnp.float32)
    k_cache = jnp.asarray(rng.normal(size=(b, hkv, max_len, d)) * 3, jnp.float32)
    v_cache = jnp.asarray(rng.normal(size=(b, hkv, max_len, d)), jnp.float32)
    k_new = jnp.asarray(rng.normal(size=(b, t, hkv, d)), jnp.float32)
    v_new = jnp.asarray(rng.normal(size=(b, t, hkv, d)), jnp.float32)
    mask = causal_mask(b, t)
    zero = jnp.zeros((b,), jnp.int32)
    got = attend_split(q, k_cache, v_cache, None, k_new, v_new, mask, new_chunk=8)
    want = attend_split(q, k_cache, v_cache, zero, k_new, v_new, mask, new_chunk=8)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got), np.asarray(attend(q, k_new, v_new, mask)), rtol=2e-5, atol=2e-5)
    # The compiled prefill has no loop over the cache (the constant-zero form has one more: t = 19
    # folds its own keys in a loop of new_chunk trips either way).
    def loops(length):
        fn = jax.jit(lambda *a: attend_split(*a[:3], length, *a[3:], new_chunk=8))
        return fn.lower(q, k_cache, v_cache, k_new, v_new, mask).as_text().count("stablehlo.while")

    assert loops(None) == loops(zero) - 1 == (1 if t > 8 else 0)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-5), (jnp.bfloat16, 3e-2)])
@pytest.mark.parametrize("t,tile", [(64, 16), (48, 16), (16, 16), (12, 16), (24, 16), (40, 16)])
def test_causal_prefill_tiles_match_dense(t, tile, dtype, tol):
    """A `Causal` mask with nothing committed: a prefill attends tile by tile below the diagonal (t a
    multiple of the tile), as one tile (t under two tiles), else through the causal mask; all equal
    one dense causal softmax, and the tiled form never forms a score block larger than one tile's."""
    from bastion_jax.modeling.attention import prefill_tile_size

    rng = np.random.default_rng(t + tile)
    b, max_len, hq, hkv, d = 2, 8, 4, 2, 8  # (hq * d = 32 is no t below: the HLO check looks for t x t)
    g = hq // hkv
    q = jnp.asarray(rng.normal(size=(b, t, hq, d)), dtype)
    k = jnp.asarray(rng.normal(size=(b, t, hkv, d)) * 3, dtype)
    v = jnp.asarray(rng.normal(size=(b, t, hkv, d)), dtype)
    garbage = jnp.asarray(rng.normal(size=(b, hkv, max_len, d)), dtype)  # never read: nothing is committed
    mask = causal_mask(b, t)
    full = Causal(jnp.full((b,), t, jnp.int32))
    got = attend_split(q, garbage, garbage, None, k, v, full, prefill_tile=tile)
    want = attend(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), mask)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=tol, atol=tol)
    masked = attend_split(q, garbage, garbage, None, k, v, mask, new_chunk=tile)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(masked, np.float32), rtol=tol, atol=tol)
    size = prefill_tile_size(t, tile)
    assert size == (tile if t % tile == 0 else t if t < 2 * tile else None)
    text = jax.jit(lambda *a: attend_split(*a, None, k, v, full, prefill_tile=tile)).lower(q, garbage, garbage).as_text()
    if size is None:  # the masked path: a [t, t] mask
        assert f"{t}x{t}x" in text
    else:  # head-major scores [b * kv_heads, groups * tile, tile]: never [t, t] unless t is one tile
        assert f"{b * hkv}x{g * size}x{size}xf32" in text
        assert (f"{g * t}x{t}x" in text) is (size == t) and f"{t}x{t}x" not in text


def test_causal_prefill_skips_the_padding_tiles():
    """Query tiles past the longest row are the bucket's padding: never attended (NaN there changes
    no real row and leaves their own output 0), the real rows equal the dense causal softmax."""
    rng = np.random.default_rng(7)
    b, t, tile, hq, hkv, d = 2, 64, 16, 4, 2, 8
    lengths = np.array([37, 20])  # the longest row ends in tile 2: tile 3 is padding for both rows
    q, k, v = (np.asarray(rng.normal(size=(b, t, h, d)), np.float32) for h in (hq, hkv, hkv))
    for x in (q, k, v):
        x[:, 48:] = np.nan
    garbage = jnp.zeros((b, hkv, 8, d))
    got = np.asarray(jax.jit(lambda *a: attend_split(*a, prefill_tile=tile))(
        jnp.asarray(q), garbage, garbage, None, jnp.asarray(k), jnp.asarray(v), Causal(jnp.asarray(lengths))))
    assert np.isfinite(got).all() and (got[:, 48:] == 0).all()
    for row, n in enumerate(lengths):
        want = attend(jnp.asarray(q[row:row + 1, :n]), jnp.asarray(k[row:row + 1, :n]),
                      jnp.asarray(v[row:row + 1, :n]), causal_mask(1, n))
        np.testing.assert_allclose(got[row, :n], np.asarray(want)[0], rtol=2e-5, atol=2e-5)


def test_prefix_trips_follow_the_step_shape(monkeypatch):
    """The prefix loop's trip size: one query per row (AR) and several (trees, drafts) take their own
    on CPU (`prefix_chunk_default`); $BASTION_PREFIX_CHUNK overrides both and is validated."""
    from bastion_jax.modeling import attention

    monkeypatch.delenv("BASTION_PREFIX_CHUNK", raising=False)
    if jax.default_backend() == "cpu":
        assert attention.prefix_chunk_default(1) == attention.CPU_PREFIX_CHUNK
        assert attention.prefix_chunk_default(16) == attention.CPU_TREE_PREFIX_CHUNK
        assert attention.CPU_TREE_PREFIX_CHUNK < attention.CPU_PREFIX_CHUNK
    else:
        assert attention.prefix_chunk_default(1) == attention.prefix_chunk_default(16) == attention.PREFIX_CHUNK
    monkeypatch.setenv("BASTION_PREFIX_CHUNK", "32")
    assert attention.prefix_chunk_default(1) == attention.prefix_chunk_default(16) == 32
    for bad in ("0", "-4", "many"):
        monkeypatch.setenv("BASTION_PREFIX_CHUNK", bad)
        with pytest.raises(ValueError, match="BASTION_PREFIX_CHUNK"):
            attention.prefix_chunk_default(4)
    # attend_split asks for the trips of its own step's queries per row (batch and groups elsewhere)
    monkeypatch.delenv("BASTION_PREFIX_CHUNK")
    asked, real = [], attention.prefix_chunk_default
    monkeypatch.setattr(attention, "prefix_chunk_default", lambda queries: asked.append(queries) or real(queries))
    rng = np.random.default_rng(0)
    k_cache, v_cache = (jnp.asarray(rng.normal(size=(2, 1, 40, 4)), jnp.float32) for _ in range(2))
    for t in (1, 4):
        q = jnp.asarray(rng.normal(size=(2, t, 2, 4)), jnp.float32)
        k = v = jnp.asarray(rng.normal(size=(2, t, 1, 4)), jnp.float32)
        attend_split(q, k_cache, v_cache, jnp.asarray([7, 30], jnp.int32), k, v, causal_mask(2, t))
    assert asked == [1, 4]
