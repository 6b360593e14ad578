import os
import tempfile

# Tests run on CPU with fp32 matmuls at full precision so parity tolerances are meaningful.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
# Most of the suite's time is XLA compiling the same steps again (in both xdist workers, in the CLI
# subprocesses, in the next run): JAX's persistent compilation cache keeps each executable once, keyed
# by its HLO and compile options, so a hit is the very executable a compile would give. Capped at 4 GiB.
# Every compile is kept, however short: the tiny models' steps compile in 0.01-0.2 s each, but an engine
# compiles its own (`Executables.compiled` bypasses jit's in-memory cache), so a file builds the same
# programs again and again (test_cond_head.py: 642 such compiles, 18.6 s; kept, the file's warm run
# 107 -> 93 s, each entry ~8 KB).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), f"bastion_jax-tests-xla-cache-{os.getuid()}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(4 << 30))
# On CPU a target's layer weights take the layout this machine multiplies faster, measured once
# (`checkpoints.layout_probe`). The suite pins one so that every worker and CLI subprocess lays models
# out alike without measuring; tests that load both layouts name them, and test_layout_probe unpins it.
os.environ.setdefault("BASTION_WEIGHTS_LAYOUT", "in-out")

import pytest  # noqa: E402


@pytest.fixture
def wrap_compiled(monkeypatch):
    """`wrap_compiled(wrap)`: every executable `Executables` compiles from then on is held as
    `wrap(executable, key)` (a spy on which steps compile, or run, and when)."""
    from bastion_jax.executables import Executables

    compiled = Executables.compiled

    def install(wrap) -> None:
        def spy(self, fn, key, args, static=None):
            if key not in self._table:
                self._table[key] = wrap(compiled(self, fn, key, args, static), key)
            return self._table[key]

        monkeypatch.setattr(Executables, "compiled", spy)

    return install


@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    """`converted(arch)` -> (torch model, loaded Target) via save_pretrained -> convert -> load."""
    import jax.numpy as jnp

    from bastion_jax.checkpoints import load_target
    from bastion_jax.testing import save_tiny_hf
    from bastion_jax.checkpoints import convert

    cache = {}

    def get(arch: str):
        if arch not in cache:
            root = tmp_path_factory.mktemp(arch)
            model = save_tiny_hf(arch, root / "hf")
            convert(root / "hf", root / "ours", dtype="float32")
            cache[arch] = (model, load_target(root / "ours", jnp.float32))
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def vocab6_target(tmp_path_factory):
    """A tiny Qwen3 target over 6 tokens: exact laws are cheap to enumerate for sampling tests."""
    import jax.numpy as jnp

    from bastion_jax.checkpoints import load_target
    from bastion_jax.testing import save_tiny_hf

    root = tmp_path_factory.mktemp("vocab6")
    save_tiny_hf("qwen3", root, vocab_size=6, seed=5)
    return load_target(root, jnp.float32)


@pytest.fixture(scope="session")
def peaked_target(tmp_path_factory):
    """The 6-token Qwen3 of `vocab6_target` with init scale 0.2 (HF's default is 0.02): next-token
    entropies of about 1.1-1.5 nats instead of ~1.78 (uniform: ln 6 = 1.79), so that a sampling-law
    test can tell a wrong temperature or a uniform draw from the target's law."""
    import jax.numpy as jnp

    from bastion_jax.checkpoints import load_target
    from bastion_jax.testing import save_tiny_hf

    root = tmp_path_factory.mktemp("peaked6")
    save_tiny_hf("qwen3", root, vocab_size=6, seed=5, initializer_range=0.2)
    return load_target(root, jnp.float32)


def _release() -> None:
    import gc

    import jax

    jax.clear_caches()
    gc.collect()


# XLA:CPU maps every compiled executable's code into the process, three mappings per kernel (code,
# constants, data): ~100 for a small jitted function, thousands for an unrolled model step. Kept alive
# by jit caches and by engines in reference cycles, the suite's executables pass Linux's default limit
# of 65,530 mappings per process (vm.max_map_count), and the next compile crashes inside XLA (SIGSEGV
# / SIGABRT; CI failed so in test_smollm2, and a full run in test_cond_head, whose tests built ~64k).
MAPPINGS_HEADROOM = 30_000


@pytest.fixture(autouse=True, scope="module")
def _release_executables():
    """Free each module's compiled executables when it ends, so that the count is what one module needs."""
    yield
    _release()


@pytest.fixture(autouse=True)
def _release_executables_when_many():
    """Within a module too, once past half the limit (a module's tests may build many engines)."""
    yield
    from bastion_jax.executables import mappings

    if mappings() > MAPPINGS_HEADROOM:
        _release()
