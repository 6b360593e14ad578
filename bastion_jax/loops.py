"""The host side of the AR and chain (dflash) policies' steps, behind `TreeLoop`'s interface.

`Engine.stream` drives one loop object per request, whatever the policy:
`loop.step(state, active, active_dev, lengths, next_key, look_ahead, tree_ahead, remaining)`
returns `(state, tokens [batch, n], counts [batch])` after one device->host read (`tree_loop.read`),
with the next step already dispatched where that is known to be needed, so the device computes while
the host emits and the caller streams:

- AR: the next step takes this one's token, still on the device, so it goes out before the read
  whenever some row has budget left (`look_ahead`). A row that stops on a stop id here is computed
  once more and its token dropped.
- chain: the next chain step is the same executable on the state this one returns, so it goes out
  before the read when every active row has room for a whole block more (`tree_ahead`), as fixed:N
  does; a row that stops on a stop id is likewise computed once more and its tokens dropped.

The state the loop returns is always the state after the last step dispatched, one step ahead of
the tokens it returns when a step is queued.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from bastion_jax.tree_loop import read


class ArLoop:
    """One target token per row per step; `state` is the target's KV cache. `first` is the prefill's
    token [batch], left on the device: the first step's input."""

    def __init__(self, step: Callable, target_params, first):
        self.fn, self.params = step, target_params
        self.cur = first  # the input of the next step to dispatch, on the device
        self.queued = None  # a step's token [batch], dispatched ahead of its predecessor's read

    def step(self, cache, active: np.ndarray, active_dev, lengths: np.ndarray, next_key: Callable,
             look_ahead: bool, tree_ahead: bool = False, remaining: np.ndarray | None = None
             ) -> tuple[Any, np.ndarray, np.ndarray]:
        # (lengths go in as NumPy: the executable's own transfer, ~25 us of CPU host time; device_put ~150)
        if self.queued is None:
            cache, self.queued = self.fn(self.params, cache, self.cur, lengths, next_key(), active_dev)
        self.cur, self.queued = self.queued, None
        if look_ahead:  # on this step's token, still on the device; each active row is one token further
            cache, self.queued = self.fn(self.params, cache, self.cur, (lengths + active).astype(np.int32),
                                         next_key(), active_dev)
        (toks,) = read(self.cur)
        return cache, toks[:, None], np.ones(len(toks), np.int64)


class ChainLoop:
    """The drafter's top-1 chain verified each step (dflash); `state` is the `SpecState`."""

    def __init__(self, step: Callable, target_params, drafter_params):
        self.fn, self.params = step, (target_params, drafter_params)
        self.queued = None  # the outputs of a step dispatched ahead of its predecessor's read

    def step(self, state, active: np.ndarray, active_dev, lengths: np.ndarray, next_key: Callable,
             look_ahead: bool, tree_ahead: bool = False, remaining: np.ndarray | None = None
             ) -> tuple[Any, np.ndarray, np.ndarray]:
        if self.queued is None:
            state, out = self.fn(*self.params, state, active_dev, next_key())
        else:
            out, self.queued = self.queued, None
        if tree_ahead:
            state, self.queued = self.fn(*self.params, state, active_dev, next_key())
        toks, counts = read(out.tokens, out.count)
        return state, toks, counts
