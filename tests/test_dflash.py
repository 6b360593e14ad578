"""DFlash drafter and chain speculative decoding.

Drafter forward vs an independent NumPy reference (incl. z-lab's attention_bias and hidden_act
variants), taps on the target's last layer vs transformers' hidden_states; T=0 output token-identical
to AR for random, oracle and half-right drafters; T>0 sampling distribution equals the target's;
pair validation.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dflash_reference import random_zlab_drafter, reference_context_features, reference_draft_logits
from flax import nnx
from safetensors.numpy import save_file

from bastion_jax.checkpoints import CheckpointError, load_drafter, random_drafter
from bastion_jax.config import TargetConfig
from bastion_jax.engine import Engine
from bastion_jax.modeling.cache import KVCache, causal_mask
from bastion_jax.sampling import SamplingConfig
from bastion_jax.testing import greedy_continuation, next_token_probs, pair_chi_square, tiny_drafter_config, two_token_law
from bastion_jax.checkpoints import convert
from bastion_jax.checkpoints.dflash import export_zlab


def _target_cfg_for(zcfg: dict) -> TargetConfig:
    return TargetConfig(model_type="qwen3", vocab_size=zcfg["vocab_size"], hidden_size=zcfg["hidden_size"],
                        intermediate_size=64, num_hidden_layers=zcfg["num_target_layers"],
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def _write_zlab(directory, cfg: dict, weights: dict, prefix: str = ""):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg))
    save_file({prefix + k: np.asarray(v, np.float32) for k, v in weights.items()}, str(directory / "model.safetensors"))
    return directory


def _draft_twice(drafter, zcfg: dict, embed, lm_head, feats, split: int):
    """Our drafter over two cached calls: context feats[:split] (root 3), then feats[split:] (root 17)."""
    model = nnx.merge(drafter.graphdef, drafter.state)
    pad, f = 8, feats.shape[1]
    cache = KVCache.create(drafter.config, 1, 32, jnp.float32)
    block = zcfg["block_size"]

    def call(ctx, ctx_start, root, cache):
        c = np.zeros((1, pad, f), np.float32)
        c[0, : len(ctx)] = ctx
        ids = np.array([root] + [zcfg["dflash_config"]["mask_token_id"]] * (block - 1))
        out, cache = model(jnp.asarray(embed[ids][None]), jnp.asarray(c), jnp.array([ctx_start]),
                           jnp.array([len(ctx)]), cache)
        return np.asarray(out)[0, 1:] @ lm_head.T, cache

    _, cache = call(feats[:split], 0, 3, cache)
    return call(feats[split:], split, 17, cache)[0]


@pytest.mark.parametrize("prefix,variant", [
    ("", {}), ("model.", {}),
    # z-lab fields beyond the Qwen3-8B drafter's: biased q/k/v/o (attention_bias) and HF ACT2FN activations
    ("", dict(attention_bias=True)), ("", dict(attention_bias=True, hidden_act="gelu")),
    ("model.", dict(hidden_act="gelu_pytorch_tanh")), ("", dict(hidden_act="relu")),
])
def test_drafter_forward_matches_numpy_reference_across_cached_calls(tmp_path, prefix, variant):
    """Context injected over two calls (with padding) == one reference call over all features."""
    rng = np.random.default_rng(0)
    zcfg, weights = random_zlab_drafter(rng, block_size=5, **variant)
    drafter = load_drafter(_write_zlab(tmp_path / "z", zcfg, weights, prefix), _target_cfg_for(zcfg), jnp.float32)
    assert (drafter.config.attention_bias, drafter.config.hidden_act) == (zcfg["attention_bias"], zcfg["hidden_act"])
    v, h = zcfg["vocab_size"], zcfg["hidden_size"]
    embed = rng.normal(size=(v, h)).astype(np.float32)
    lm_head = rng.normal(size=(v, h)).astype(np.float32)
    feats = rng.normal(size=(11, 2 * h)).astype(np.float32)
    got = _draft_twice(drafter, zcfg, embed, lm_head, feats, split=7)
    ref = reference_draft_logits(weights, zcfg, embed, lm_head, feats, 17)
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["silu", "swish", "gelu", "gelu_new", "gelu_pytorch_tanh", "relu"])
def test_drafter_activations_are_hf_act2fn(name):
    """Each supported hidden_act is the function transformers' ACT2FN gives that name (gelu exact vs
    tanh differ by up to ~5e-4 here, far above the tolerance)."""
    import torch
    from transformers.activations import ACT2FN

    from bastion_jax.modeling.layers import ACTIVATIONS

    x = np.linspace(-6.0, 6.0, 241, dtype=np.float32)
    ref = ACT2FN[name](torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(np.asarray(ACTIVATIONS[name](jnp.asarray(x))), ref, atol=2e-6, rtol=0)


def test_zlab_biases_and_activation_survive_export_and_convert(tmp_path):
    """A biased gelu drafter read from z-lab files, exported again and converted, is the same drafter."""
    rng = np.random.default_rng(1)
    zcfg, weights = random_zlab_drafter(rng, attention_bias=True, hidden_act="gelu_new")
    target_cfg = _target_cfg_for(zcfg)
    first = load_drafter(_write_zlab(tmp_path / "z", zcfg, weights), target_cfg, jnp.float32)
    export_zlab(first.config, first.state, tmp_path / "again", dtype=jnp.float32)
    convert(tmp_path / "again", tmp_path / "ours", dtype="float32")
    exported = json.loads((tmp_path / "again" / "config.json").read_text())
    assert (exported["attention_bias"], exported["hidden_act"]) == (True, "gelu_new")
    for path in (tmp_path / "again", tmp_path / "ours"):
        back = load_drafter(path, target_cfg, jnp.float32)
        assert back.config == first.config
        np.testing.assert_array_equal(np.asarray(back.state["layers"][1]["self_attn"]["o_proj"]["bias"][...]),
                                      weights["layers.1.self_attn.o_proj.bias"])
        for a, b in zip(jax.tree.leaves(first.state), jax.tree.leaves(back.state)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("arch", ["qwen3", "llama3"])
def test_tap_on_last_target_layer_is_hf_hidden_state_after_final_norm(converted, arch):
    """z-lab reads HF hidden_states[id + 1]; for the last layer that entry is after model.norm.
    Our taps (last layer first, then layer 0) equal the reference built from transformers' own
    output_hidden_states; a raw (un-normed) last-layer tap fails this."""
    import torch

    hf, target = converted(arch)
    ids = np.random.default_rng(2).integers(0, hf.config.vocab_size, (1, 9))
    with torch.no_grad():
        hs = [h.numpy() for h in hf(torch.as_tensor(ids), output_hidden_states=True).hidden_states]
    last = target.config.num_hidden_layers - 1
    taps = (last, 0)
    model = nnx.merge(target.graphdef, target.state)
    start = jnp.zeros(1, jnp.int32)
    out = model(jnp.asarray(ids), jnp.arange(9)[None], KVCache.create(target.config, 1, 16, jnp.float32), start,
                causal_mask(start.shape[0], 9), tap_layers=taps)
    np.testing.assert_allclose(np.asarray(out.taps), reference_context_features(hs, taps), atol=1e-4, rtol=1e-4)


def test_zlab_export_convert_roundtrip(tmp_path, converted):
    _, target = converted("qwen3")
    d = random_drafter(tiny_drafter_config(target.config, block_size=4), seed=3)
    export_zlab(d.config, d.state, tmp_path / "zlab", dtype=jnp.float32)
    convert(tmp_path / "zlab", tmp_path / "ours", dtype="float32")
    for path in (tmp_path / "zlab", tmp_path / "ours"):
        back = load_drafter(path, target.config)
        assert back.config == d.config
        for a, b in zip(jax.tree.leaves(d.state), jax.tree.leaves(back.state)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("field,value,needle", [
    ("hidden_size", 48, "hidden_size"),
    ("vocab_size", 50, "vocab_size"),
    ("target_layer_ids", [0, 9], "target_layer_ids"),
    ("mask_token_id", 500, "mask_token_id"),
])
def test_drafter_target_mismatch_is_one_clear_error(tmp_path, converted, field, value, needle):
    _, target = converted("qwen3")
    d = random_drafter(tiny_drafter_config(target.config, block_size=4))
    out = export_zlab(d.config, d.state, tmp_path / "z", dtype=jnp.float32)
    cfg = json.loads((out / "config.json").read_text())
    if field in ("target_layer_ids", "mask_token_id"):
        cfg["dflash_config"][field] = value
    else:
        cfg[field] = value
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=needle) as e:
        load_drafter(out, target.config)
    assert "\n" not in str(e.value) and "drafter" in str(e.value)


# -- chain speculative decoding -----------------------------------------------------------------

BLOCK = 6
PROMPTS = [[5, 9, 11, 40], [7, 3, 20, 21, 22, 23, 24, 25, 60]]


def _table_proposal(table: np.ndarray, vocab: int, correct_upto: int):
    """Drafts from the answer key for slots k <= correct_upto, a wrong token after that."""
    table = jnp.asarray(table)

    def propose(root, start, logits):
        k = jnp.arange(1, logits.shape[1] + 1)
        idx = jnp.clip(start[:, None] + k[None], 0, table.shape[0] - 1)
        tok = table[idx]
        tok = jnp.where(k[None] <= correct_upto, tok, (tok + 1) % vocab)
        return jax.nn.one_hot(tok, vocab)

    return propose


def _random_proposal(vocab: int):
    def propose(root, start, logits):
        key = jax.random.fold_in(jax.random.PRNGKey(7), start[0])
        return jax.random.normal(key, logits.shape)

    return propose


@pytest.mark.parametrize("arch", ["qwen3", "llama3"])
def test_t0_identical_to_ar_with_random_drafter_model(converted, arch):
    """A random drafter model (drafts almost always rejected) still gives AR's tokens exactly."""
    _, target = converted(arch)
    drafter = random_drafter(tiny_drafter_config(target.config, block_size=BLOCK), seed=1)
    engine = Engine(target, drafter=drafter, stop_ids=[-1])
    ar = engine.generate(PROMPTS, max_new_tokens=30, mode="ar").tokens
    res = engine.generate(PROMPTS, max_new_tokens=30, mode="dflash")
    assert res.tokens == ar


@pytest.mark.parametrize("correct_upto,expect_tau", [(BLOCK - 1, BLOCK), (2, 3), (0, 1)])
def test_t0_identical_to_ar_with_oracle_and_partial_drafters(converted, correct_upto, expect_tau):
    _, target = converted("qwen3")
    n = 30
    prompt = PROMPTS[0]
    table = greedy_continuation(target, prompt, n + BLOCK)
    engine = Engine(target, stop_ids=[-1], block_size=BLOCK,
                    proposal=_table_proposal(table, target.config.vocab_size, correct_upto))
    res = engine.generate([prompt], max_new_tokens=n, mode="dflash")
    assert res.tokens[0] == table[len(prompt): len(prompt) + n].tolist()
    assert res.stats.tau == pytest.approx(expect_tau)


def test_t0_identical_to_ar_with_random_proposal_and_stop_token(converted):
    _, target = converted("llama3")
    table = greedy_continuation(target, PROMPTS[1], 40)
    stop = int(table[len(PROMPTS[1]) + 12])  # a token the greedy output reaches
    ar = Engine(target, stop_ids=[stop]).generate(PROMPTS, max_new_tokens=40).tokens
    engine = Engine(target, stop_ids=[stop], block_size=BLOCK, proposal=_random_proposal(target.config.vocab_size))
    assert engine.generate(PROMPTS, max_new_tokens=40, mode="dflash").tokens == ar
    assert ar[1][-1] == stop


def test_no_recompilation_after_warmup_dflash(converted):
    _, target = converted("qwen3")
    drafter = random_drafter(tiny_drafter_config(target.config, block_size=BLOCK))
    engine = Engine(target, drafter=drafter, stop_ids=[-1])
    engine.generate([PROMPTS[0]], max_new_tokens=12, mode="dflash")
    n = engine.compilations
    engine.generate([[4, 4, 4]], max_new_tokens=12, mode="dflash")
    assert engine.compilations == n == 2


def test_sampling_through_verification_matches_target_distribution(vocab6_target):
    """Joint law of the first two sampled tokens equals the target's, for drafts that are often
    accepted. A rule that accepted drafts by argmax (as public BASTION code does at T>0) fails."""
    target, prompt = vocab6_target, [1, 4, 3]
    joint = two_token_law(target, prompt)
    # Propose, after every root, the target's most likely continuation token: accepted often.
    table = jnp.asarray(np.array([np.argmax(next_token_probs(target, prompt + [a])) for a in range(6)]))

    def propose(root, start, logits):
        return jax.nn.one_hot(jnp.broadcast_to(table[root][:, None], logits.shape[:2]), 6)

    engine = Engine(target, stop_ids=[-1], block_size=3, proposal=propose)
    res = engine.generate([prompt] * 6000, max_new_tokens=2, mode="dflash", sampling=SamplingConfig(1.0), seed=11)
    assert res.stats.tau > 1.2  # drafts were really accepted
    assert pair_chi_square(res.tokens, joint) < 80.0  # ~35 dof: p < 1e-4 for a correct sampler


def test_convert_keeps_the_files_a_drafter_reads_beside_it(tmp_path):
    """The shipped drafter's token ranking and datastore travel with a conversion: without them the
    converted drafter would draft over the whole vocabulary with no datastore (slower, silently)."""
    from bastion_jax.default_model import default_drafter_dir

    src = default_drafter_dir()
    conv = convert(src, tmp_path / "conv", dtype="float32")
    for name in ("vocab_ranking.npy", "datastore.npz"):
        assert (conv / name).read_bytes() == (src / name).read_bytes(), name
