"""The AR and chain policies' host loops (`loops.ArLoop`, `loops.ChainLoop`): the next step goes out
before this one is read where it is known to be needed, each step gets its own key in order, the
state returned is the last dispatched step's, and nothing goes ahead past the budget; and the
per-step sampling keys (`sampling.KeyStream`)."""

import types

import jax
import numpy as np

from bastion_jax import loops
from bastion_jax.loops import ArLoop, ChainLoop
from bastion_jax.sampling import KeyStream


def _logged_read(log, monkeypatch):
    real = loops.read
    monkeypatch.setattr(loops, "read", lambda *a: (log.append(("read",)), real(*a))[1])


def test_chain_steps_are_dispatched_one_ahead(monkeypatch):
    """dflash: the next chain step goes out on the state this one returned, before this one's read,
    while every row has room for a whole block more (tree_ahead); the tokens read are always the
    oldest step's, and the state handed back is the newest dispatched one's."""
    log, batch = [], 2

    def chain(tp, dp, state, active, key):
        log.append(("dispatch", key))
        out = types.SimpleNamespace(tokens=np.full((batch, 3), key), count=np.full(batch, 1 + key % 3, np.int32))
        return state + 1, out  # the state counts the steps dispatched on it

    _logged_read(log, monkeypatch)
    loop, keys, state = ChainLoop(chain, None, None), iter(range(100)), 0
    active = np.ones(batch, bool)
    got = []
    for i in range(5):
        state, toks, counts = loop.step(state, active, active, np.zeros(batch, np.int32), lambda: next(keys),
                                        True, tree_ahead=i < 3)
        got.append((int(toks[0, 0]), int(counts[0]), state))
    assert log == [("dispatch", 0), ("dispatch", 1), ("read",), ("dispatch", 2), ("read",), ("dispatch", 3),
                   ("read",), ("read",), ("dispatch", 4), ("read",)]
    # Step i's tokens come back from step i's read, in order, with the state of the last dispatch.
    assert got == [(0, 1, 2), (1, 2, 3), (2, 3, 4), (3, 1, 4), (4, 2, 5)]
    assert loop.queued is None


def test_ar_steps_take_the_last_token_on_the_device_and_go_one_ahead(monkeypatch):
    """AR: each step's input is the previous step's token as it stays on the device; the next step
    goes out before the read while some row has budget (look_ahead), one position further for the
    active rows only; each token is read once, in order."""
    log = []
    seen = []

    def decode(tp, cache, tokens, lengths, key, active):
        log.append(("dispatch", key))
        seen.append((np.asarray(tokens).tolist(), np.asarray(lengths).tolist()))
        return cache + 1, np.asarray(tokens) + 10

    _logged_read(log, monkeypatch)
    loop, keys = ArLoop(decode, None, np.array([1, 2])), iter(range(100))
    cache, lengths, active = 0, np.array([5, 7], np.int32), np.array([True, False])
    out = []
    for i in range(3):
        cache, toks, counts = loop.step(cache, active, active, lengths, lambda: next(keys), look_ahead=i < 1)
        out.append(toks[:, 0].tolist())
        assert counts.tolist() == [1, 1]
        lengths = lengths + active
    assert log == [("dispatch", 0), ("dispatch", 1), ("read",), ("read",), ("dispatch", 2), ("read",)]
    assert out == [[11, 12], [21, 22], [31, 32]] and cache == 3
    # The step sent ahead started one position further for the active row only.
    assert seen[:2] == [([1, 2], [5, 7]), ([11, 12], [6, 7])]


def test_key_stream_is_the_chunked_split_in_order():
    """Each step's key is the next of `split(rng, CHUNK + 1)[:CHUNK]`, the chunk's last key seeding
    the next chunk: distinct, deterministic, and as NumPy (no device op per step)."""
    rng = jax.random.PRNGKey(3)
    stream = KeyStream(rng)
    got = np.stack([stream.next() for _ in range(2 * KeyStream.CHUNK + 5)])
    first = np.asarray(jax.random.split(rng, KeyStream.CHUNK + 1))
    second = np.asarray(jax.random.split(first[-1], KeyStream.CHUNK + 1))
    third = np.asarray(jax.random.split(second[-1], KeyStream.CHUNK + 1))
    want = np.concatenate([first[:-1], second[:-1], third[:5]])
    assert isinstance(stream.next(), np.ndarray)
    np.testing.assert_array_equal(got, want)
    assert len({tuple(k) for k in got}) == len(got)
    again = KeyStream(rng)
    np.testing.assert_array_equal(np.stack([again.next() for _ in range(10)]), got[:10])
