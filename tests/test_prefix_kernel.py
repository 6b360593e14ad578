"""The Pallas prefix kernel (the GPU path of `attend_split`), run through the Pallas interpreter on CPU:
the same partial as the XLA loop, the same attention as the dense reference, and the same greedy
output as AR when a whole model decodes with it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bastion_jax.modeling import attention, prefix_kernel
from bastion_jax.modeling.attention import group_queries, attend, attend_split, empty, set_prefix_kernel
from bastion_jax.modeling.cache import write_rows


@pytest.fixture
def interpreted():
    old = set_prefix_kernel("interpret")
    yield
    set_prefix_kernel(old)


def _inputs(rng, b, t, slots, hq=4, hkv=2, d=16, dtype=jnp.float32):
    q = jnp.asarray(rng.normal(size=(b, t, hq, d)), dtype)
    k_cache = jnp.asarray(rng.normal(size=(b, hkv, slots, d)) * 3, dtype)  # the cache's layout
    v_cache = jnp.asarray(rng.normal(size=(b, hkv, slots, d)), dtype)
    return q, k_cache, v_cache


@pytest.mark.parametrize("t", [1, 5, 40])
@pytest.mark.parametrize("lengths", [[0, 1, 63, 64], [65, 200, 255, 256]])
def test_kernel_partial_equals_the_xla_loop(t, lengths):
    """Lengths at, around and between key blocks (64) and splits; 0 = nothing committed yet. t = 40:
    80 query rows per kv head, two row blocks of MAX_ROWS."""
    rng = np.random.default_rng(t)
    q, k_cache, v_cache = _inputs(rng, len(lengths), t, 256)
    length = jnp.asarray(lengths, jnp.int32)
    qg = group_queries(q, k_cache.shape[1])
    want = attention.prefix(empty(q, k_cache.shape[1]), qg, k_cache, v_cache, length)
    got = prefix_kernel.prefix(qg, k_cache, v_cache, length, interpret=True)
    seen = np.asarray(lengths) > 0
    for name in ("m", "l", "acc"):
        g, w = np.asarray(getattr(got, name)), np.asarray(getattr(want, name))
        np.testing.assert_allclose(g[seen], w[seen], rtol=2e-5, atol=2e-5, err_msg=name)
    assert (np.asarray(got.l)[~seen] == 0).all() and (np.asarray(got.acc)[~seen] == 0).all()


@pytest.mark.parametrize("t", [3, 40])
def test_kernel_reads_one_layer_of_a_stacked_cache(t):
    """With scanned layers the cache is [layers, b, kv, slots, d]: the kernel reads layer `layer` (a traced
    index inside the scan) in place, as the loop does; t = 40: two row blocks."""
    rng = np.random.default_rng(4)
    q, _, _ = _inputs(rng, 2, t, 128)
    k_stack = jnp.asarray(rng.normal(size=(3, 2, 2, 128, 16)) * 3, jnp.float32)
    v_stack = jnp.asarray(rng.normal(size=(3, 2, 2, 128, 16)), jnp.float32)
    length = jnp.asarray([10, 100], jnp.int32)
    qg = group_queries(q, 2)
    for layer in (0, 2):
        want = attention.prefix(empty(q, 2), qg, k_stack[layer], v_stack[layer], length)
        got = jax.jit(lambda i: prefix_kernel.prefix(qg, k_stack, v_stack, length, i, interpret=True))(jnp.int32(layer))
        for name in ("m", "l", "acc"):
            np.testing.assert_allclose(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), rtol=2e-5,
                                       atol=2e-5, err_msg=f"{name} layer {layer}")


def test_stale_slots_never_reach_the_output():
    rng = np.random.default_rng(0)
    q, k_cache, v_cache = _inputs(rng, 2, 3, 128)
    length = jnp.asarray([10, 70], jnp.int32)
    qg = group_queries(q, 2)
    clean = prefix_kernel.prefix(qg, k_cache, v_cache, length, interpret=True)
    dirty = prefix_kernel.prefix(qg, k_cache.at[:, :, 70:].set(jnp.nan).at[0, :, 10:].set(jnp.nan),
                                 v_cache.at[:, :, 70:].set(jnp.nan).at[0, :, 10:].set(jnp.nan), length, interpret=True)
    for name in ("m", "l", "acc"):
        np.testing.assert_array_equal(np.asarray(getattr(clean, name)), np.asarray(getattr(dirty, name)))


def test_split_attention_with_the_kernel_equals_dense(interpreted):
    """Prefix by the kernel + a tree-masked new part, merged: the dense attention over [prefix | new]."""
    rng = np.random.default_rng(1)
    b, t, slots = 2, 4, 192
    q, k_cache, v_cache = _inputs(rng, b, t, slots)
    k_new = jnp.asarray(rng.normal(size=(b, t, 2, 16)) * 3, jnp.float32)
    v_new = jnp.asarray(rng.normal(size=(b, t, 2, 16)), jnp.float32)
    tree = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], bool)  # node -> its ancestors
    mask = jnp.asarray(np.broadcast_to(tree, (b, t, t)))
    lengths = np.array([30, 150])
    assert attention.prefix_kernel_mode(16, slots) == "interpret"
    got = attend_split(q, k_cache, v_cache, jnp.asarray(lengths, jnp.int32), k_new, v_new, mask)
    dense = np.zeros((b, t, slots), bool)
    for r, n in enumerate(lengths):
        dense[r, :, :n] = True
        dense[r, :, n:n + t] = tree
    slot_major = [c.swapaxes(1, 2) for c in (k_cache, v_cache)]  # [b, slots, kv, d]: the dense reference's keys
    want = attend(q, write_rows(slot_major[0], k_new, jnp.asarray(lengths)),
                  write_rows(slot_major[1], v_new, jnp.asarray(lengths)), jnp.asarray(dense))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_shapes_the_kernel_does_not_take_keep_the_loop(interpreted):
    assert attention.prefix_kernel_mode(16, 256) == "interpret"
    assert attention.prefix_kernel_mode(24, 256) is None  # head_dim not a power of two
    assert attention.prefix_kernel_mode(64, 200) is None  # cache not whole key blocks
    set_prefix_kernel("auto")  # the kernel on GPU, the XLA loop elsewhere
    assert attention.prefix_kernel_mode(64, 256) == ("pallas" if jax.default_backend() == "gpu" else None)
    with pytest.raises(ValueError, match="unknown prefix attention mode"):
        set_prefix_kernel("triton")


@pytest.mark.parametrize("mode", ["dflash", "fixed:8"])
def test_greedy_decoding_with_the_kernel_equals_ar(converted, interpreted, mode):
    """A whole tiny model (target and drafter attention) decoding with the interpreted kernel."""
    from bastion_jax.checkpoints import random_drafter
    from bastion_jax.engine import Engine
    from bastion_jax.testing import tiny_drafter_config

    _, target = converted("qwen3")
    assert target.config.head_dim & (target.config.head_dim - 1) == 0
    drafter = random_drafter(tiny_drafter_config(target.config, num_layers=1, block_size=4), seed=3)
    prompts = [[5, 17, 3, 9], [7, 7, 2]]
    set_prefix_kernel("xla")
    ar = Engine(target, stop_ids=[-1]).generate(prompts, max_new_tokens=12).tokens
    set_prefix_kernel("interpret")
    out = Engine(target, drafter=drafter, stop_ids=[-1], buckets=(1, 8)).generate(prompts, max_new_tokens=12, mode=mode)
    assert out.tokens == ar


@pytest.mark.parametrize("dtype,t,hq,hkv,d,slots", [(jnp.bfloat16, 64, 32, 8, 128, 8192),  # Qwen3-8B, verify(64)
                                                   (jnp.float32, 1, 9, 3, 64, 512)])  # SmolLM2, an AR step
def test_kernel_lowers_to_triton_for_cuda(dtype, t, hq, hkv, d, slots):
    """No GPU needed: lowering for the CUDA platform runs the Pallas -> Triton lowering of the kernel
    body (what a GPU compiles from), so an op Triton cannot take fails here."""
    qg = jax.ShapeDtypeStruct((2, t, hkv, hq // hkv, d), dtype)
    cache = jax.ShapeDtypeStruct((2, hkv, slots, d), dtype)
    length = jax.ShapeDtypeStruct((2,), jnp.int32)
    check = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    exported = jax.export.export(jax.jit(prefix_kernel.prefix), platforms=["cuda"], disabled_checks=[check])(
        qg, cache, cache, length)
    calls = [line for line in exported.mlir_module().splitlines() if "__gpu$xla.gpu.triton" in line]
    assert len(calls) == 1 and 'name = "bastion_prefix_attention"' in calls[0]


@pytest.mark.parametrize("scan", [False, True])
def test_a_whole_tree_step_lowers_for_cuda_with_the_kernel(converted, scan):
    """The tree step (verify + accept + compact + draft) traced for CUDA with the kernel on: target and
    drafter attention both become the Triton kernel, and nothing else in the step blocks GPU lowering."""
    from bastion_jax import tree_decoding
    from bastion_jax.checkpoints import random_drafter
    from bastion_jax.engine import Engine
    from bastion_jax.testing import tiny_drafter_config

    from bastion_jax.checkpoints import load_target

    _, target = converted("qwen3")
    target = load_target(target.path, jnp.float32, scan_layers=scan)
    drafter = random_drafter(tiny_drafter_config(target.config, num_layers=1, block_size=4), seed=3)
    exe = Engine(target, drafter=drafter, stop_ids=[-1], buckets=(1, 8)).executables
    args = exe._tree_step_args(exe.config(), 1, 256)
    old = set_prefix_kernel("pallas")
    try:
        check = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
        exported = jax.export.export(tree_decoding.tree_step, platforms=["cuda"], disabled_checks=[check])(
            *args, bucket=8)
    finally:
        set_prefix_kernel(old)
    kernels = {line.split('name = "')[1].split('"')[0] for line in exported.mlir_module().splitlines()
               if "__gpu$xla.gpu.triton" in line}
    assert kernels == {"bastion_prefix_attention"}
    assert exported.mlir_module().count("__gpu$xla.gpu.triton") == 2  # the target's shape and the drafter's


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="compiles the kernel for a GPU (benchmarks/gpu_session.sh)")
@pytest.mark.parametrize("dtype,t,lengths", [(jnp.bfloat16, 64, [1, 700, 2048, 8191]), (jnp.float32, 1, [0, 64, 65, 3000])])
def test_compiled_kernel_equals_the_xla_loop_on_gpu(dtype, t, lengths):
    """The kernel as a GPU runs it (Triton, not interpreted) at Qwen3-8B head shapes."""
    rng = np.random.default_rng(7)
    q, k_cache, v_cache = _inputs(rng, len(lengths), t, 8192, hq=32, hkv=8, d=128, dtype=dtype)
    length = jnp.asarray(lengths, jnp.int32)
    qg = group_queries(q, 8)
    want = attention.prefix(empty(q, 8), qg, k_cache, v_cache, length)
    got = prefix_kernel.prefix(qg, k_cache, v_cache, length)
    seen = np.asarray(lengths) > 0
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-4
    out_got = np.asarray(got.acc)[seen] / np.asarray(got.l)[seen][..., None]
    out_want = np.asarray(want.acc)[seen] / np.asarray(want.l)[seen][..., None]
    np.testing.assert_allclose(out_got, out_want, rtol=tol, atol=tol)
