"""Tiny random models for tests and examples (no downloads): HF configs, saved checkpoints, tokenizers.

Lives in the package (like gemma's `testing` module) so downstream code can build the same dummies.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bastion_jax.presets import tiny_drafter_config  # noqa: F401  (tests build drafters with it)

TINY_VOCAB = 96


def tiny_hf_config(arch: str, **overrides: Any) -> dict[str, Any]:
    """HF config kwargs for a 3-layer model of the given family ("qwen3" or "llama3")."""
    base = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "qwen3":
        base.update(head_dim=16, rope_theta=10000.0, tie_word_embeddings=False)
    elif arch == "llama3":
        # Llama-3.1 rope scaling with a small original context so all three bands are exercised.
        base.update(rope_theta=500000.0, tie_word_embeddings=True,
                    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                      high_freq_factor=4.0, original_max_position_embeddings=64))
    else:
        raise ValueError(f"unknown tiny arch {arch!r}")
    base.update(overrides)
    return base


def tiny_hf_model(arch: str, seed: int = 0, **overrides: Any):
    """A random transformers model (float32) for `arch`; needs torch."""
    import torch
    import transformers

    cfg_cls, model_cls = {
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "llama3": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    }[arch]
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**tiny_hf_config(arch, **overrides)))
    # HF initialises norms to 1; randomise them so a swapped or missing norm cannot hide.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    return model.eval()


def tiny_tokenizer(vocab_size: int = TINY_VOCAB):
    """A word-level tokenizer over `vocab_size` tokens: '<pad>', '<s>', '</s>', '<unk>', then w4, w5, ..."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({f"w{i}": i for i in range(4, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    from tokenizers import decoders

    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>")


def save_tiny_hf(arch: str, directory: str | Path, seed: int = 0, **overrides: Any):
    """Save a tiny random HF model + tokenizer to `directory`; returns the torch model."""
    directory = Path(directory)
    model = tiny_hf_model(arch, seed, **overrides)
    model.save_pretrained(directory)
    tiny_tokenizer(model.config.vocab_size).save_pretrained(directory)
    return model


def greedy_continuation(target, prompt, n: int):
    """prompt + n greedy tokens of `target` (an answer key for oracle drafters), as int32 numpy."""
    import numpy as np

    from bastion_jax.engine import Engine

    ar = Engine(target, stop_ids=[-1]).generate([list(prompt)], max_new_tokens=n).tokens[0]
    return np.array(list(prompt) + ar, np.int32)


def next_token_probs(target, seq):
    """The target's next-token distribution after `seq` (float64), by a plain forward."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from bastion_jax.modeling.cache import KVCache, causal_mask

    model = nnx.merge(target.graphdef, target.state)
    n = len(seq)
    start = jnp.zeros(1, jnp.int32)
    cache = KVCache.create(target.config, 1, n, target.dtype)
    out = model(jnp.asarray([seq]), jnp.arange(n)[None], cache, start, causal_mask(start.shape[0], n))
    return np.asarray(jax.nn.softmax(out.logits[0, -1]), np.float64)


def two_token_law(target, prompt):
    """Exact joint law [v, v] of the next two tokens after `prompt` under temperature-1 sampling."""
    import numpy as np

    v = target.config.vocab_size
    p1 = next_token_probs(target, list(prompt))
    return np.array([p1[a] * next_token_probs(target, list(prompt) + [a]) for a in range(v)])


def pair_chi_square(generated, joint, min_expected: float = 5.0) -> float:
    """Pearson chi-square of the first two generated tokens of each row against `joint`."""
    import numpy as np

    pairs = np.array([t[:2] for t in generated])
    counts = np.zeros_like(joint)
    np.add.at(counts, (pairs[:, 0], pairs[:, 1]), 1)
    expected = joint * len(pairs)
    m = expected > min_expected
    return float(((counts[m] - expected[m]) ** 2 / expected[m]).sum())


def next_token_logits(target, seqs):
    """The target's logits after every prefix of each of the equal-length `seqs` [n, t] (one plain
    forward): [n, t, vocab] float64, row [i, j] the logits of the token after seqs[i][: j + 1]."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from bastion_jax.modeling.cache import KVCache, causal_mask

    seqs = np.asarray(seqs, np.int32)
    n, t = seqs.shape
    model = nnx.merge(target.graphdef, target.state)
    start = jnp.zeros(n, jnp.int32)
    cache = KVCache.create(target.config, n, t, target.dtype)
    out = model(jnp.asarray(seqs), jnp.broadcast_to(jnp.arange(t), (n, t)), cache, start, causal_mask(start.shape[0], t))
    return np.asarray(out.logits, np.float64)


def filtered_probs(logits, sampling):
    """NumPy restatement of `sampling.filter_logits` + softmax: the law `sample` draws from, [..., vocab].

    Temperature first; then top-k keeps every token whose tempered logit is >= the k-th largest
    (ties at the k-th are all kept); then top-p, over what top-k left, keeps the smallest prefix of
    the tokens sorted by descending logit whose mass before each kept token is < top_p, plus every
    token tied with the last one kept. Greedy (T = 0) is a point mass on the first argmax."""
    import numpy as np

    logits = np.asarray(logits, np.float64)
    if sampling.greedy:
        return np.eye(logits.shape[-1])[np.argmax(logits, axis=-1)]
    z = logits / sampling.temperature
    v = z.shape[-1]
    if sampling.top_k and sampling.top_k < v:
        kth = np.sort(z, axis=-1)[..., -sampling.top_k][..., None]
        z = np.where(z < kth, -np.inf, z)
    if sampling.top_p < 1.0:
        desc = np.sort(z, axis=-1)[..., ::-1]
        p = np.exp(desc - desc[..., :1])
        p /= p.sum(-1, keepdims=True)
        keep = np.cumsum(p, axis=-1) - p < sampling.top_p
        threshold = np.min(np.where(keep, desc, np.inf), axis=-1, keepdims=True)
        z = np.where(z < threshold, -np.inf, z)
    p = np.exp(z - z.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


def token_law(target, prompt, n: int, sampling=None):
    """Exact joint law [vocab] * n of the next `n` tokens after `prompt` when every token is drawn
    by `sample` with `sampling` (default: plain temperature 1), by enumerating every (n - 1)-token
    continuation in one forward (vocab ** (n - 1) rows)."""
    import itertools

    import numpy as np

    from bastion_jax.sampling import SamplingConfig

    sampling = sampling or SamplingConfig(1.0)
    v = target.config.vocab_size
    tails = list(itertools.product(range(v), repeat=n - 1))
    logits = next_token_logits(target, [list(prompt) + list(t) for t in tails])  # [rows, len, v]
    probs = filtered_probs(logits[:, len(prompt) - 1:], sampling)  # [rows, n, v]: token i+1 after tail[:i]
    law = np.zeros((v,) * n)
    for row, tail in enumerate(tails):
        # P(tail + (x,)) = prod_i P(tail[i] | tail[:i]) * P(x | tail); every row holds all n factors.
        lead = np.prod([probs[row, i, tail[i]] for i in range(n - 1)])
        law[tail] = lead * probs[row, n - 1]
    return law


def law_chi_square(generated, law, min_expected: float = 5.0):
    """Pearson chi-square of the first `law.ndim` generated tokens of each row against `law`.

    Cells expecting >= `min_expected` samples are kept; the other possible cells are merged into one
    (kept if it too expects that many). Returns (chi2, dof, impossible): dof = kept cells - 1, and
    `impossible` counts rows whose tokens have probability 0 under `law` (a filter let through a
    token it must remove): any such row is a failure by itself."""
    import numpy as np

    n = law.ndim
    rows = np.array([t[:n] for t in generated])
    if rows.ndim != 2 or rows.shape[1] != n or rows.min() < 0 or rows.max() >= law.shape[0]:
        raise ValueError(f"every row needs {n} token ids in [0, {law.shape[0]})")
    counts = np.zeros_like(law)
    np.add.at(counts, tuple(rows.T), 1)
    expected = law * len(rows)
    impossible = int(counts[law == 0].sum())
    big = expected >= min_expected
    small = ~big & (law > 0)
    obs, exp = list(counts[big]), list(expected[big])
    if expected[small].sum() >= min_expected:
        obs.append(counts[small].sum())
        exp.append(expected[small].sum())
    obs, exp = np.array(obs), np.array(exp)
    return float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1, impossible


class ChainsPay:
    """A latency model stub where drafting never pays (a draft costs 5 AR steps) but verifying a few
    nodes nearly costs an AR step (1.0 + 0.01 b): bastion then holds and verifies the context lookup's
    chains without drafting whenever one is expected to yield anything. No online correction."""

    def predict(self, b, c):
        return {"ar": 1.0, "ar+draft": 6.0}.get(b) or 6.0 + 0.01 * b

    def step_time(self, b, c, draft):
        return (1.0 if b == 0 else 1.0 + 0.01 * b) + (5.0 if draft else 0.0)

    def observe(self, *a):
        pass


class DraftingPays:
    """A latency model stub (seconds, no online correction) where drafting pays: AR 1.0, a draft 0.2,
    verifying a tree of b nodes 1.0 + 0.01 b. On a tiny CPU model a plain AR step really is cheaper
    and the draft gate would rightly stop drafting; tests that need trees verified pass this as
    `Engine(latency=...)`. The controller then prefers bucket 8 to bucket 4. It prices every batch
    alike (no `for_batch`), so the engine uses it as is."""

    def predict(self, b, c):
        return {"ar": 1.0, "ar+draft": 1.2}.get(b) or 1.2 + 0.01 * b

    def step_time(self, b, c, draft):
        return (1.0 if b == 0 else self.predict(b, c) - 0.2) + (0.2 if draft else 0.0)

    def observe(self, *a):
        pass


def one_error_line(err: str, *fragments: str) -> str:
    """The one line a CLI's refusal writes to stderr (`error: ...`, no traceback), checked to hold every
    fragment; returned for further checks. The project's rule for bad input, asserted by many tests."""
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{err}"
    assert lines[0].startswith("error: ") and "Traceback" not in err, err
    for f in fragments:
        assert f in lines[0], f"{f!r} not in {lines[0]!r}"
    return lines[0]
