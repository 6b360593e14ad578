"""Our target vs transformers on tiny random Qwen3 and Llama-3.1 (rope-scaled) models, fp32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from bastion_jax.engine import Engine
from bastion_jax.modeling.cache import KVCache, causal_mask
from bastion_jax.sampling import SamplingConfig, sampler

ARCHS = ["qwen3", "llama3"]
TOL = 1e-4


def hf_logits(model, ids: np.ndarray, hidden: bool = False):
    with torch.no_grad():
        out = model(torch.as_tensor(ids, dtype=torch.long), output_hidden_states=hidden)
    return out


def ours(target, ids: np.ndarray, cache: KVCache, start: np.ndarray, tap_layers=()):
    model = nnx.merge(target.graphdef, target.state)
    b, t = ids.shape
    start = jnp.asarray(start, jnp.int32)
    positions = start[:, None] + jnp.arange(t)[None]
    return model(jnp.asarray(ids), positions, cache, start, causal_mask(start.shape[0], t),
                 tap_layers=tap_layers)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match_transformers(converted, arch):
    hf, target = converted(arch)
    ids = np.random.default_rng(0).integers(0, hf.config.vocab_size, (2, 37))
    ref = hf_logits(hf, ids).logits.numpy()
    out = ours(target, ids, KVCache.create(target.config, 2, 64, jnp.float32), np.zeros(2))
    np.testing.assert_allclose(np.asarray(out.logits), ref, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("arch", ARCHS)
def test_incremental_decode_matches_full_forward(converted, arch):
    """Prefill 20 tokens, then feed one token at a time; each step equals HF's full-sequence logits.

    Positions run past the rope-scaling original context (64) for the llama3 config.
    """
    hf, target = converted(arch)
    n, steps = 60, 12
    ids = np.random.default_rng(1).integers(0, hf.config.vocab_size, (1, n + steps))
    ref = hf_logits(hf, ids).logits.numpy()[0]
    cache = KVCache.create(target.config, 1, 128, jnp.float32)
    out = ours(target, ids[:, :n], cache, np.zeros(1))
    np.testing.assert_allclose(np.asarray(out.logits)[0], ref[:n], atol=TOL, rtol=TOL)
    cache = out.cache
    for i in range(steps):
        out = ours(target, ids[:, n + i: n + i + 1], cache, np.array([n + i]))
        cache = out.cache
        np.testing.assert_allclose(np.asarray(out.logits)[0, 0], ref[n + i], atol=TOL, rtol=TOL)


@pytest.mark.parametrize("arch", ARCHS)
def test_tapped_layers_are_hf_hidden_states(converted, arch):
    """Tap id j == HF hidden_states[j + 1] (raw output of decoder layer j), concatenated in order."""
    hf, target = converted(arch)
    ids = np.random.default_rng(2).integers(0, hf.config.vocab_size, (1, 9))
    hs = hf_logits(hf, ids, hidden=True).hidden_states
    taps = (1, 0)
    out = ours(target, ids, KVCache.create(target.config, 1, 16, jnp.float32), np.zeros(1), taps)
    ref = np.concatenate([hs[j + 1].numpy() for j in taps], axis=-1)
    np.testing.assert_allclose(np.asarray(out.taps), ref, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("arch", ARCHS)
def test_long_prefill_tiles_match_transformers(converted, arch):
    """A prompt longer than one prefill tile (300 tokens, bucket 512: two 256-token tiles) through the
    engine's own prefill (`prefill_target`, the causal tiled attention): the first new token of each
    row and the tapped hidden states of every real position equal transformers'."""
    from bastion_jax.decoding import prefill_target

    hf, target = converted(arch)
    lengths = np.array([300, 261])
    ids = np.random.default_rng(4).integers(3, hf.config.vocab_size, (2, 512))
    model = nnx.merge(target.graphdef, target.state)
    greedy = sampler(jax.random.PRNGKey(0), SamplingConfig())
    first, _, taps = prefill_target(model, KVCache.create(target.config, 2, 512, jnp.float32), jnp.asarray(ids),
                                    jnp.asarray(lengths, jnp.int32), greedy, (0, 1))
    for row, n in enumerate(lengths):
        out = hf_logits(hf, ids[row: row + 1, :n], hidden=True)
        assert int(first[row]) == int(out.logits[0, -1].argmax())
        ref = np.concatenate([out.hidden_states[j + 1][0].numpy() for j in (0, 1)], axis=-1)
        np.testing.assert_allclose(np.asarray(taps[row, :n]), ref, atol=TOL, rtol=TOL)


def test_long_prompts_pad_to_a_tile_and_decode_as_transformers(tmp_path):
    """Prompts over two prefill tiles pad to a multiple of the tile (600 -> 768, not 1024) and all
    modes decode them exactly as transformers' greedy generate does (a batch of two lengths)."""
    from bastion_jax.checkpoints import load_target, random_drafter
    from bastion_jax.shapes import prefill_bucket
    from bastion_jax.testing import save_tiny_hf, tiny_drafter_config

    lengths = (5, 64, 65, 200, 256, 257, 400, 512, 513, 600, 1377, 2048)
    assert [prefill_bucket(n, 4096, fine=False) for n in lengths] == [16, 64, 128, 256, 256, 512, 512, 512, 768,
                                                                      768, 1536, 2048]
    # finer on CPU (the default there): multiples of 32 up to 256, of 64 up to two tiles
    assert [prefill_bucket(n, 4096, fine=True) for n in lengths] == [16, 64, 96, 224, 256, 320, 448, 512, 768,
                                                                     768, 1536, 2048]
    assert prefill_bucket(200, 4096) == (224 if jax.default_backend() == "cpu" else 256)
    assert prefill_bucket(600, 700) == 700 and prefill_bucket(200, 210) == 210  # never past the cache
    hf = save_tiny_hf("qwen3", tmp_path, max_position_embeddings=1024)
    target = load_target(tmp_path, jnp.float32)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, hf.config.vocab_size, n).tolist() for n in (600, 530)]
    drafter = random_drafter(tiny_drafter_config(target.config, block_size=4), seed=1)
    engine = Engine(target, drafter=drafter, stop_ids=[-1], buckets=(1, 4), top_k=2)
    refs = [hf_greedy_free(hf, p, 6) for p in prompts]
    for mode in ("ar", "bastion"):
        assert engine.generate(prompts, max_new_tokens=6, mode=mode).tokens == refs, mode


def hf_greedy_free(hf, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens of transformers with no stop token."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                          attention_mask=torch.ones(1, len(prompt), dtype=torch.long), eos_token_id=None,
                          pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                          attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          eos_token_id=hf.config.eos_token_id, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generation_token_identical_to_transformers(converted, arch):
    hf, target = converted(arch)
    rng = np.random.default_rng(3)
    for length in (5, 23):
        prompt = rng.integers(3, hf.config.vocab_size, length).tolist()
        engine = Engine(target, stop_ids=[-1])  # no stop token: compare all 24 tokens
        got = engine.generate([prompt], max_new_tokens=24).tokens[0]
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                              attention_mask=torch.ones(1, length, dtype=torch.long),
                              eos_token_id=None, pad_token_id=0)[0, length:].tolist()
        assert got == ref


def test_generation_stops_at_eos(converted):
    """With the model's EOS as a stop id, output equals HF generate() cut after its first EOS."""
    hf, target = converted("qwen3")
    prompt = [5, 9, 11]
    ref = hf_greedy(hf, prompt, 30)
    eos = ref[4]  # pretend the 5th greedy token is EOS: both must stop right after it
    engine = Engine(target, stop_ids=[eos])
    got = engine.generate([prompt], max_new_tokens=30).tokens[0]
    assert got == ref[: ref.index(eos) + 1]


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_generation_equals_one_by_one(converted, arch):
    _, target = converted(arch)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, 90, n).tolist() for n in (3, 17, 9)]
    engine = Engine(target, stop_ids=[7])
    batched = engine.generate(prompts, max_new_tokens=16).tokens
    single = [engine.generate([p], max_new_tokens=16).tokens[0] for p in prompts]
    assert batched == single


def test_sampling_is_seeded_and_respects_top_k(converted):
    _, target = converted("qwen3")
    engine = Engine(target, stop_ids=[-1])
    s = SamplingConfig(temperature=1.0, top_k=1)
    greedy = engine.generate([[4, 5, 6]], max_new_tokens=8).tokens
    # top_k=1 at any temperature is greedy decoding.
    assert engine.generate([[4, 5, 6]], max_new_tokens=8, sampling=s, seed=3).tokens == greedy
    s = SamplingConfig(temperature=1.5)
    a = engine.generate([[4, 5, 6]], max_new_tokens=8, sampling=s, seed=1).tokens
    b = engine.generate([[4, 5, 6]], max_new_tokens=8, sampling=s, seed=1).tokens
    c = engine.generate([[4, 5, 6]], max_new_tokens=8, sampling=s, seed=2).tokens
    assert a == b and a != c


def test_no_recompilation_across_requests(converted):
    _, target = converted("llama3")
    engine = Engine(target, stop_ids=[-1])
    engine.generate([[4, 5, 6]], max_new_tokens=8)
    n = engine.compilations
    engine.generate([[9, 8, 7, 6]], max_new_tokens=8)  # same buckets: nothing new to compile
    assert engine.compilations == n == 2
