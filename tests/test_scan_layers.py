"""Scanned decoder layers (`TargetConfig.scan_layers`, a choice; unrolled is the default): the same checkpoint loaded
stacked gives the same logits, caches and greedy tokens as unrolled, in float32 and bfloat16, with the
XLA prefix loop and with the prefix kernel; checkpoints stay per layer. Likewise the layers' linear
weights held [in, out] (`TargetConfig.weights_in_out`, the default on CPU): same logits and tokens
as HF's [out, in], and checkpoints stay in HF layout; and HF's layout multiplied feature-major
(`TargetConfig.feature_major`): same logits and tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bastion_jax.checkpoints import layer_layout, load_target, random_drafter, save_target
from bastion_jax.engine import Engine
from bastion_jax.modeling.attention import set_prefix_kernel
from bastion_jax.modeling.cache import KVCache, causal_mask
from bastion_jax.testing import tiny_drafter_config

PROMPTS = [[5, 17, 3, 9, 22], [7, 7, 2]]


@pytest.fixture(scope="module")
def both(converted):
    """(unrolled, scanned) loads of one converted tiny Qwen3 checkpoint."""
    _, target = converted("qwen3")
    return (load_target(target.path, jnp.float32, scan_layers=False, weights_in_out=False),
            load_target(target.path, jnp.float32, scan_layers=True, weights_in_out=False))


def test_layouts(both):
    flat, scanned = both
    assert not flat.config.scan_layers and scanned.config.scan_layers
    n = flat.config.num_hidden_layers
    w = scanned.state["layers"]["mlp"]["up_proj"]["weight"][...]  # [layers, ...]: one stacked module
    assert w.shape[0] == n
    np.testing.assert_array_equal(np.asarray(w[1]), np.asarray(flat.state["layers"][1]["mlp"]["up_proj"]["weight"][...]))
    cache = KVCache.create(scanned.config, 2, 32, jnp.float32)
    shape = (n, 2, flat.config.num_key_value_heads, 32, flat.config.head_dim)  # each head's slots contiguous
    assert cache.k.shape == cache.v.shape == shape
    assert KVCache.create(flat.config, 2, 32, jnp.float32).k.shape == shape  # one layout, scanned or not


def test_forward_logits_cache_and_taps_equal_unrolled(both):
    flat, scanned = both
    rng = np.random.default_rng(0)
    t = 9
    tokens = jnp.asarray(rng.integers(3, flat.config.vocab_size, (2, t)), jnp.int32)
    zero = jnp.zeros(2, jnp.int32)
    taps = (0, flat.config.num_hidden_layers - 1)
    outs = []
    for target in (flat, scanned):
        model = nnx.merge(target.graphdef, target.state)
        cache = KVCache.create(target.config, 2, 32, jnp.float32)
        outs.append(model(tokens, jnp.arange(t)[None].repeat(2, 0), cache, zero, causal_mask(2, t), tap_layers=taps))
    a, b = outs
    np.testing.assert_allclose(np.asarray(a.logits), np.asarray(b.logits), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(a.taps), np.asarray(b.taps), rtol=1e-5, atol=1e-5)
    for layer in range(flat.config.num_hidden_layers):
        np.testing.assert_allclose(np.asarray(a.cache.k[layer]), np.asarray(b.cache.k[layer]), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(a.cache.v[layer]), np.asarray(b.cache.v[layer]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("prefix", ["xla", "interpret"])
def test_greedy_output_equals_unrolled_ar(both, dtype, prefix):
    """AR, chain and tree decoding with scanned layers give the unrolled model's AR tokens."""
    flat, _ = both
    scanned = load_target(flat.path, dtype, scan_layers=True, weights_in_out=False)
    unrolled = load_target(flat.path, dtype, scan_layers=False, weights_in_out=False)
    drafter = random_drafter(tiny_drafter_config(flat.config, num_layers=1, block_size=4), dtype, seed=3)
    want = Engine(unrolled, stop_ids=[-1]).generate(PROMPTS, max_new_tokens=14).tokens
    old = set_prefix_kernel(prefix)
    try:
        engine = Engine(scanned, drafter=drafter, stop_ids=[-1], buckets=(1, 4, 8))
        for mode in ("ar", "dflash", "fixed:8"):
            assert engine.generate(PROMPTS, max_new_tokens=14, mode=mode).tokens == want, mode
    finally:
        set_prefix_kernel(old)


def test_checkpoints_stay_per_layer(both, tmp_path):
    """A scanned model saves one tensor per layer (HF names) and loads back either way, bit for bit."""
    flat, scanned = both
    (tmp_path / "ckpt").mkdir()
    save_target(tmp_path / "ckpt", scanned.config, nnx.to_pure_dict(scanned.state))
    back = load_target(tmp_path / "ckpt", scan_layers=False, weights_in_out=False)
    assert "0" in {str(k) for k in nnx.to_pure_dict(back.state)["layers"]}
    for x, y in zip(jax.tree.leaves(back.state), jax.tree.leaves(flat.state)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_layers_are_unrolled_unless_asked():
    """Unrolled by default on every backend: XLA copies a scanned layer's weights out of the stack
    every step (CPU and GPU alike, `default_scan_layers`)."""
    from bastion_jax.checkpoints import default_scan_layers
    from bastion_jax.presets import preset_configs

    tcfg, _ = preset_configs("smollm2-135m", 2, 1, 4)
    assert default_scan_layers() is False
    assert layer_layout(tcfg).scan_layers is default_scan_layers()
    assert layer_layout(tcfg, True).scan_layers and not layer_layout(tcfg, False).scan_layers
    assert "scan_layers" not in tcfg.to_hf()  # a run-time choice, never written into a checkpoint


@pytest.fixture(scope="module")
def hf_and_io(both):
    """(HF layout, [in, out]) loads of the checkpoint, unrolled."""
    flat, _ = both
    return flat, load_target(flat.path, jnp.float32, scan_layers=False, weights_in_out=True)


def test_weights_in_out_holds_the_transpose(hf_and_io):
    hf, io = hf_and_io
    assert io.config.weights_in_out and not hf.config.weights_in_out
    for block, proj in (("self_attn", "q_proj"), ("self_attn", "o_proj"), ("mlp", "gate_proj"), ("mlp", "down_proj")):
        w_hf = np.asarray(hf.state["layers"][1][block][proj]["weight"][...])  # [out, in]
        w_io = np.asarray(io.state["layers"][1][block][proj]["weight"][...])  # [in, out]
        np.testing.assert_array_equal(w_io, w_hf.T)
    np.testing.assert_array_equal(np.asarray(io.state["embed_tokens"]["weight"][...]),
                                  np.asarray(hf.state["embed_tokens"]["weight"][...]))  # not a layer weight


def test_weights_in_out_logits_equal_hf_layout(hf_and_io):
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(3, hf_and_io[0].config.vocab_size, (2, 7)), jnp.int32)
    outs = []
    for target in hf_and_io:
        model = nnx.merge(target.graphdef, target.state)
        cache = KVCache.create(target.config, 2, 32, jnp.float32)
        outs.append(model(tokens, jnp.arange(7)[None].repeat(2, 0), cache, jnp.zeros(2, jnp.int32), causal_mask(2, 7)))
    np.testing.assert_allclose(np.asarray(outs[0].logits), np.asarray(outs[1].logits), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype, scan", [(jnp.float32, False), (jnp.bfloat16, True)])
def test_weights_in_out_greedy_output_equals_hf_layout_ar(both, dtype, scan):
    """AR, chain and tree decoding with [in, out] weights (unrolled and scanned) give the HF-layout
    model's AR tokens."""
    flat, _ = both
    io = load_target(flat.path, dtype, scan_layers=scan, weights_in_out=True)
    want = Engine(load_target(flat.path, dtype, scan_layers=False, weights_in_out=False), stop_ids=[-1]).generate(
        PROMPTS, max_new_tokens=14).tokens
    drafter = random_drafter(tiny_drafter_config(flat.config, num_layers=1, block_size=4), dtype, seed=3)
    engine = Engine(io, drafter=drafter, stop_ids=[-1], buckets=(1, 4, 8))
    for mode in ("ar", "dflash", "fixed:8"):
        assert engine.generate(PROMPTS, max_new_tokens=14, mode=mode).tokens == want, mode


@pytest.mark.parametrize("scan", [False, True])
def test_weights_in_out_checkpoints_stay_hf_layout(hf_and_io, tmp_path, scan):
    """A model holding [in, out] weights saves HF's [out, in] and loads back either way, bit for bit."""
    hf, _ = hf_and_io
    io = load_target(hf.path, jnp.float32, scan_layers=scan, weights_in_out=True)
    (tmp_path / "ckpt").mkdir()
    save_target(tmp_path / "ckpt", io.config, nnx.to_pure_dict(io.state))
    for layout, like in ((False, hf), (True, load_target(hf.path, jnp.float32, scan_layers=False, weights_in_out=True))):
        back = load_target(tmp_path / "ckpt", scan_layers=False, weights_in_out=layout)
        got, want = jax.tree.leaves(back.state), jax.tree.leaves(like.state)
        assert len(got) == len(want)  # no tensor lost on the way
        for x, y in zip(got, want):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_weights_layout_follows_the_backend():
    from bastion_jax.checkpoints import default_weights_layout
    from bastion_jax.presets import preset_configs

    tcfg, _ = preset_configs("smollm2-135m", 2, 1, 4)
    assert default_weights_layout() == ("in-out" if jax.default_backend() == "cpu" else "out-in")
    assert layer_layout(tcfg).weights_layout == default_weights_layout(tcfg)
    assert layer_layout(tcfg).weights_in_out is (default_weights_layout(tcfg) == "in-out")
    assert layer_layout(tcfg, weights_in_out=False).weights_in_out is False
    assert "weights_in_out" not in tcfg.to_hf()  # a run-time choice, never written into a checkpoint
    assert "feature_major" not in tcfg.to_hf()


@pytest.fixture(scope="module")
def hf_and_fm(both):
    """(HF layout, feature-major products) loads of the checkpoint, unrolled."""
    flat, _ = both
    return flat, load_target(flat.path, jnp.float32, scan_layers=False, weights_in_out=False, feature_major=True)


def _forward(target, tokens):
    model = nnx.merge(target.graphdef, target.state)
    cache = KVCache.create(target.config, tokens.shape[0], 32, jnp.float32)
    t = tokens.shape[1]
    return model(tokens, jnp.arange(t)[None].repeat(tokens.shape[0], 0), cache, jnp.zeros(tokens.shape[0], jnp.int32),
                 causal_mask(tokens.shape[0], t))


def test_feature_major_products_give_hf_logits(hf_and_fm):
    """Same weights (HF's [out, in]), products taken W @ x^T: the logits of a 7-token forward are the
    HF layout's, and the form really is another program (its transposes are barriers)."""
    hf, fm = hf_and_fm
    assert fm.config.feature_major and fm.config.weights_layout == "feature-major"
    for x, y in zip(jax.tree.leaves(fm.state), jax.tree.leaves(hf.state)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    tokens = jnp.asarray(np.random.default_rng(1).integers(3, hf.config.vocab_size, (2, 7)), jnp.int32)
    np.testing.assert_allclose(np.asarray(_forward(fm, tokens).logits), np.asarray(_forward(hf, tokens).logits),
                               rtol=1e-5, atol=1e-5)
    if jax.default_backend() == "cpu":
        assert "optimization_barrier" in str(jax.make_jaxpr(lambda t: _forward(fm, t).logits)(tokens))
        assert "optimization_barrier" not in str(jax.make_jaxpr(lambda t: _forward(hf, t).logits)(tokens))


def test_feature_major_form_is_for_a_few_rows():
    """W @ x^T up to FEATURE_MAJOR_MAX_ROWS rows (a tree, a block), the plain product above (a long
    prefill, where the plain one was faster); the same numbers either way."""
    from bastion_jax.modeling.layers import FEATURE_MAJOR_MAX_ROWS, project

    if jax.default_backend() != "cpu":
        pytest.skip("the feature-major form is a CPU one")
    w = jnp.asarray(np.random.default_rng(0).normal(size=(24, 16)), jnp.float32)  # [out, in]
    for rows, form in ((FEATURE_MAJOR_MAX_ROWS, True), (FEATURE_MAJOR_MAX_ROWS + 1, False)):
        x = jnp.asarray(np.random.default_rng(rows).normal(size=(1, rows, 16)), jnp.float32)
        jaxpr = str(jax.make_jaxpr(lambda x: project("...i,oi->...o", x, w, feature_major=True))(x))
        assert ("optimization_barrier" in jaxpr) is form, rows
        np.testing.assert_allclose(project("...i,oi->...o", x, w, feature_major=True), x @ w.T, rtol=1e-5, atol=1e-5)


def test_feature_major_refuses_in_out(both):
    from bastion_jax.config import ConfigError

    with pytest.raises(ConfigError, match="feature_major products take the weights' \\[out, in\\] layout"):
        layer_layout(both[0].config, weights_in_out=True, feature_major=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_feature_major_greedy_output_equals_hf_layout_ar(both, dtype):
    """AR, chain and tree decoding with feature-major products in the target and the drafter give
    the HF-layout model's AR tokens (bf16 keeps the plain products: the form is float32's)."""
    import dataclasses

    flat, _ = both
    fm = load_target(flat.path, dtype, scan_layers=False, weights_in_out=False, feature_major=True)
    want = Engine(load_target(flat.path, dtype, scan_layers=False, weights_in_out=False), stop_ids=[-1]).generate(
        PROMPTS, max_new_tokens=14).tokens
    dcfg = dataclasses.replace(tiny_drafter_config(flat.config, num_layers=1, block_size=4), feature_major=True)
    drafter = random_drafter(dcfg, dtype, seed=3)
    engine = Engine(fm, drafter=drafter, stop_ids=[-1], buckets=(1, 4, 8))
    for mode in ("ar", "dflash", "fixed:8"):
        assert engine.generate(PROMPTS, max_new_tokens=14, mode=mode).tokens == want, mode


@pytest.fixture(scope="module")
def drafters(both, tmp_path_factory):
    """(unrolled, scanned) loads of one exported 2-layer random drafter, beside the scanned target."""
    from bastion_jax.checkpoints import export_zlab, load_drafter

    flat, _ = both
    made = random_drafter(tiny_drafter_config(flat.config, num_layers=2, block_size=4), jnp.float32, seed=5)
    path = export_zlab(made.config, made.state, tmp_path_factory.mktemp("drafter"), jnp.float32)
    return (load_drafter(path, flat.config, jnp.float32, scan_layers=False),
            load_drafter(path, flat.config, jnp.float32, scan_layers=True))


def test_drafter_layout_follows_the_target(both, drafters):
    from bastion_jax.checkpoints import load_drafter

    flat, scanned = both
    unrolled_d, scanned_d = drafters
    assert not unrolled_d.config.scan_layers and scanned_d.config.scan_layers
    assert load_drafter(unrolled_d.path, scanned.config).config.scan_layers
    assert not load_drafter(unrolled_d.path, flat.config).config.scan_layers
    assert tiny_drafter_config(scanned.config).scan_layers and not tiny_drafter_config(flat.config).scan_layers
    fm = layer_layout(flat.config, weights_in_out=False, feature_major=True)  # the products' form too
    assert load_drafter(unrolled_d.path, fm).config.feature_major and tiny_drafter_config(fm).feature_major
    assert not load_drafter(unrolled_d.path, flat.config).config.feature_major
    w = scanned_d.state["layers"]["mlp"]["up_proj"]["weight"][...]  # [layers, ...]: one stacked module
    np.testing.assert_array_equal(np.asarray(w[1]), np.asarray(unrolled_d.state["layers"][1]["mlp"]["up_proj"]["weight"][...]))


@pytest.mark.parametrize("cached", [False, True])
def test_scanned_drafter_equals_unrolled(drafters, cached):
    """A drafting call (the prefill's, and a later one that reads the cache) and the trainer's
    many-block forward give the same states and cache with the layers scanned."""
    unrolled_d, scanned_d = drafters
    cfg = unrolled_d.config
    rng = np.random.default_rng(1)
    b, c, blk = 2, 6, cfg.block_size
    feats = jnp.asarray(rng.normal(size=(b, c, len(cfg.target_layer_ids) * cfg.target_hidden_size)), jnp.float32)
    emb = jnp.asarray(rng.normal(size=(b, blk, cfg.hidden_size)), jnp.float32)
    start = jnp.asarray([3, 5], jnp.int32) if cached else None
    lens = jnp.asarray([6, 4], jnp.int32)
    outs = []
    for d in drafters:
        model = nnx.merge(d.graphdef, d.state)
        cache = KVCache.create(cfg, b, 32, jnp.float32)
        if cached:  # something already in the cache for the call to read
            cache = model.inject(feats[:, ::-1], jnp.zeros(b, jnp.int32), jnp.full(b, c, jnp.int32), cache,
                                     jnp.float32)
        h, cache = model(emb, feats, start, lens, cache)
        pos = jnp.broadcast_to(jnp.arange(c, c + blk)[None], (b, blk))
        mask = jnp.ones((b, blk, c + blk), bool)
        outs.append((h, cache.k, cache.v, model.forward_blocks(emb, pos, feats, mask)))
    for x, y in zip(*outs):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)


def test_scanned_pair_greedy_equals_ar_and_exports_per_layer(both, drafters, tmp_path):
    """Scanned target + scanned drafter: chain and tree decoding give the unrolled AR tokens, and the
    scanned drafter exports the z-lab per-layer tensors byte for byte."""
    from safetensors.numpy import load_file

    from bastion_jax.checkpoints import export_zlab

    flat, scanned = both
    unrolled_d, scanned_d = drafters
    want = Engine(flat, stop_ids=[-1]).generate(PROMPTS, max_new_tokens=14).tokens
    engine = Engine(scanned, drafter=scanned_d, stop_ids=[-1], buckets=(1, 4, 8))
    for mode in ("dflash", "fixed:8", "bastion"):
        assert engine.generate(PROMPTS, max_new_tokens=14, mode=mode).tokens == want, mode
    a = load_file(str(export_zlab(scanned_d.config, scanned_d.state, tmp_path / "s", jnp.float32) / "model.safetensors"))
    b = load_file(str(export_zlab(unrolled_d.config, unrolled_d.state, tmp_path / "u", jnp.float32) / "model.safetensors"))
    assert a.keys() == b.keys() and any(".1." in k for k in a)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def test_scanned_drafter_kernels_do_not_grow_with_depth(both):
    """One compiled layer body whatever the drafter's depth (the scanned layout), where unrolled layers
    add ~70 kernels each (XLA:GPU's compile time follows the kernel count)."""
    import dataclasses

    from benchmarks.compile_probe import count_kernels
    from bastion_jax.modeling.drafter import Drafter

    _, scanned = both

    def kernels(layers: int, scan: bool) -> int:
        cfg = dataclasses.replace(tiny_drafter_config(scanned.config, num_layers=layers, block_size=4), scan_layers=scan)
        graphdef, state = nnx.split(nnx.eval_shape(lambda: Drafter(cfg, rngs=nnx.Rngs(0))))
        cache = jax.eval_shape(lambda: KVCache.create(cfg, 1, 32, jnp.float32))
        feats = jax.ShapeDtypeStruct((1, 8, len(cfg.target_layer_ids) * cfg.target_hidden_size), jnp.float32)
        rows = jax.ShapeDtypeStruct((1,), jnp.int32)

        def call(state, cache, feats, start, lens):
            emb = jnp.zeros((1, cfg.block_size, cfg.hidden_size), jnp.float32)
            return nnx.merge(graphdef, state)(emb, feats, start, lens, cache)

        return count_kernels(jax.jit(call).lower(state, cache, feats, rows, rows).compile().as_text())

    assert kernels(2, True) == kernels(5, True) < kernels(5, False)


def test_unrolled_layers_are_traced_once_per_shape(both, monkeypatch):
    """Unrolled layers share one trace per step shape (a nested jit; XLA inlines it), so lowering a
    step does not trace every layer again: a 30-layer SmolLM2 step lowered in ~1.2 s, ~0.75 s of it
    tracing layer copies."""
    from bastion_jax.modeling import transformer

    flat, _ = both
    assert flat.config.num_hidden_layers > 1
    calls = []
    original = transformer.DecoderLayer.__call__
    monkeypatch.setattr(transformer.DecoderLayer, "__call__",
                        lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    if hasattr(transformer, "_unrolled_layer"):
        transformer._unrolled_layer.clear_cache()  # traces of other tests do not count

    def forward(state, tokens):
        model = nnx.merge(flat.graphdef, state)
        cache = KVCache.create(flat.config, 1, 32, jnp.float32)
        t = tokens.shape[1]
        return model(tokens, jnp.arange(t)[None], cache, jnp.zeros(1, jnp.int32), causal_mask(1, t)).logits

    for t in (3, 5):
        jax.jit(forward).lower(flat.state, jax.ShapeDtypeStruct((1, t), jnp.int32))
    assert len(calls) == 2  # one trace per shape, not one per layer


def test_a_new_prefix_kernel_setting_traces_the_layer_again(both, monkeypatch):
    """The prefix-attention setting is read when a layer is traced, so it keys the shared layer trace:
    a step lowered after `set_prefix_kernel` does not reuse the layer traced under the old setting."""
    from bastion_jax.modeling import transformer

    flat, _ = both
    calls = []
    original = transformer.DecoderLayer.__call__
    monkeypatch.setattr(transformer.DecoderLayer, "__call__",
                        lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    transformer._unrolled_layer.clear_cache()

    def lower():  # a new outer function each time (JAX caches an outer trace by the function)
        def forward(state, tokens):
            model = nnx.merge(flat.graphdef, state)
            cache = KVCache.create(flat.config, 1, 32, jnp.float32)
            return model(tokens, jnp.arange(3)[None], cache, jnp.zeros(1, jnp.int32), causal_mask(1, 3)).logits

        jax.jit(forward).lower(flat.state, jax.ShapeDtypeStruct((1, 3), jnp.int32))

    old = set_prefix_kernel("xla")
    try:
        lower()
        set_prefix_kernel("interpret")
        lower()
    finally:
        set_prefix_kernel(old)
    assert len(calls) == 2
