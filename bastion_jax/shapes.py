"""The static shapes a request is compiled for: its KV cache's length class and its prompt's bucket.

Every executable is compiled per shape, so these grids trade compilations (once per machine, with the
persistent cache) against padding (paid on every request).
"""

from __future__ import annotations

from bastion_jax.modeling.attention import PREFILL_TILE


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def cache_class(need: int) -> int:
    """The smallest of 256, 384, 512, 768, 1024, 1536, ... (powers of two and 1.5 times them) that
    holds `need` slots. Every executable is compiled per cache length, and a step's cost follows
    its live context, not the cache's size (`modeling.attention`), so coarse classes cost memory
    only (less than half again the slots needed), while requests of different lengths share their
    compiled steps: from 512 to 8,192 slots 8 classes instead of the 31 of a 256-slot grain (a new
    class is a dozen compilations for bastion, ~50 s on a 2-core CPU)."""
    size = 256
    while size < need:
        size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
    return size


def prefill_bucket(n: int, cache_len: int, minimum: int = 16, fine: bool | None = None) -> int:
    """The prompt length a prefill is compiled for, capped at the cache: a power of two up to 64;
    then, where `fine` (None: on CPU), a multiple of 32 up to 256 and of 64 up to two prefill tiles
    (elsewhere powers of two up to two tiles); past two tiles a multiple of the tile (powers of two
    padded a 1,377-token prompt to 2,048: 49% more rows through every matmul).

    Why finer on CPU: there a prefill's time follows its padded length (SmolLM2 bf16 on a 2-core
    EPYC, the tree prefill: 119 / 151 / 176 / 229 / 275 ms at 96 / 128 / 160 / 224 / 256 tokens),
    so a 145-token prompt paid 256 tokens' prefill (the PyTorch originals' time to first token was
    0.6x ours on such prompts, `benchmarks/results/cpu-smollm2-vs-torch-*`), while a new bucket
    compiles in ~12 s, once per machine. On a GPU a prefill of a few hundred tokens costs little
    more than one of a few dozen and a compilation far more (tens of seconds at 8B shapes), so
    there the coarse grid stays."""
    if fine is None:
        import jax

        fine = jax.default_backend() == "cpu"
    bucket = max(minimum, next_pow2(n))
    if bucket > 2 * PREFILL_TILE:
        bucket = -(-n // PREFILL_TILE) * PREFILL_TILE
    elif fine and bucket > 64:
        grain = 32 if n <= PREFILL_TILE else 64
        bucket = -(-n // grain) * grain
    return min(bucket, cache_len)
