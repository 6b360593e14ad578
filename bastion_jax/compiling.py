"""Compiling a lowered step off the caller's thread, with the options every step compiles with.

`Executables` lowers each step on the caller's thread (Python) and hands it here: XLA compiles it,
or loads it from JAX's persistent cache, on a worker thread (`compile_async`), and the returned
`Compiling` stands in for the executable until it is ready.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import jax


class Compiling:
    """A step being compiled (or loaded from JAX's persistent cache) on a worker thread: calls and
    attribute reads wait for it once, then go straight to the compiled executable.

    Why: `jit(...).lower()` is Python (it holds the GIL), while XLA's compile and a cache load run in
    C++ without it, so the engine lowers a request's next step while earlier ones compile. On a
    2-core CPU a warm bastion request's 13 SmolLM2 steps lowered in 8.7 s and loaded from the
    persistent cache in 10.9 s one after the other, in two threads in 6.3 s, and that overlaps the
    lowering: with the warm-up's first runs side by side (`warmup.first_runs`), a warm README command's
    warm-up 39-43 -> 24-26 s."""

    def __init__(self, future: Future):
        self._future = future
        self._exe = None

    def result(self):
        """The compiled executable (waits for the worker; re-raises its error)."""
        if self._exe is None:
            self._exe = self._future.result()
        return self._exe

    def done(self) -> bool:
        """Whether the worker has finished (compiled, loaded or failed)."""
        return self._exe is not None or self._future.done()

    def __call__(self, *args):
        return (self._exe or self.result())(*args)

    def __getattr__(self, name: str):  # (only names this class lacks: the executable's own)
        return getattr(self.result(), name)


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    """The process's compile workers. On CPU a few at once (XLA:CPU compiles use ~1.5 cores each;
    loads from the cache one). On an accelerator one, still beside the lowering: XLA:GPU autotunes
    kernels on the device while compiling, and compiles side by side would time them against each
    other."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            workers = min(4, max(2, os.cpu_count() or 2)) if jax.default_backend() == "cpu" else 1
            _POOL = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="bastion-compile")
        return _POOL


# Every bf16 rounding the code asks for happens, whatever XLA fuses: with excess precision allowed, a
# rounding kept in one step shape (a 1-token AR step) and fused away in another (a 16-node verify)
# can flip an argmax, and greedy output would no longer equal AR's (seen with scanned layers).
# Changes nothing in float32.
COMPILER_OPTIONS = {"xla_allow_excess_precision": False}
# On CPU, LLVM at -O1 instead of XLA's default -O3: a 2-core machine compiles the unrolled SmolLM2 steps
# 13-15% faster (a profile's 84-86 s -> 73-74 s; a fresh machine's first run pays every compile) and
# runs them as fast (AR 26-29 vs 26 ms, tree(4) 41-43 vs 38-40, tree(16) 64-65 vs 58-62: the products
# are library calls, the code LLVM emits is the fusions around them). -O0 halved compiles but slowed
# steps 1.6x. Without fast-math LLVM may not reorder float sums at any level: same numbers.
CPU_COMPILER_OPTIONS = {"xla_backend_optimization_level": 1}


def compiler_options() -> dict:
    """What every step compiles with on this process's backend."""
    return COMPILER_OPTIONS | (CPU_COMPILER_OPTIONS if jax.default_backend() == "cpu" else {})


def compile_async(lowered) -> Compiling:
    """`lowered.compile(...)` with `compiler_options()` on a compile worker."""
    return Compiling(_pool().submit(lowered.compile, compiler_options=compiler_options()))
