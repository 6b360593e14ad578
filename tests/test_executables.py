"""`Executables` compiles off the main thread: a step is lowered where it is asked for (Python, under
the GIL) and compiled or loaded from the persistent cache on a worker, so the next step lowers
meanwhile; calls wait for it, `ready()` waits for all, and a failed compile says so at the call."""

from __future__ import annotations

import copy
import threading

import jax
import numpy as np
import pytest

from bastion_jax.compiling import Compiling
from bastion_jax.executables import Executables
from bastion_jax.sampling import SamplingConfig, sampler


def _executables(target) -> Executables:
    return Executables(target, None, proposal=None, block_size=None, mask_token_id=0, buckets=(1,), top_k=1,
                       draft_vocab=None)


def test_a_step_compiles_on_a_worker_and_its_call_waits_for_it(converted, monkeypatch):
    model, target = converted("llama3")
    exe = _executables(target)
    asked = threading.Event()  # set once `ar` has returned both steps
    seen: list[tuple[str, bool]] = []
    compile_ = jax.stages.Lowered.compile

    def slow_compile(self, *args, **kwargs):
        # A compile done inline would wait here in vain (ar() cannot return first) and see False.
        seen.append((threading.current_thread().name, asked.wait(timeout=10)))
        return compile_(self, *args, **kwargs)

    monkeypatch.setattr(jax.stages.Lowered, "compile", slow_compile)
    prefill, step = exe.ar(1, 16, 64)
    asked.set()
    assert isinstance(prefill, Compiling) and isinstance(step, Compiling) and exe.compilations == 2
    exe.ready()
    assert len(seen) == 2 and all(ok for _, ok in seen), seen
    assert all(name != threading.main_thread().name for name, _ in seen), seen

    # The compiled prefill works as before: its token is transformers' greedy choice.
    import torch

    prompt = [3, 17, 29, 41, 7]
    tokens = np.zeros((1, 16), np.int32)
    tokens[0, :5] = prompt
    _, nxt = prefill(exe.target_params, exe.new_cache(1, 64), tokens, np.array([5], np.int32),
                     sampler(jax.random.PRNGKey(0), SamplingConfig()))
    with torch.no_grad():
        want = int(model(torch.tensor([prompt])).logits[0, -1].argmax())
    assert int(np.asarray(nxt)[0]) == want
    assert exe.ar(1, 16, 64) == (prefill, step) and exe.compilations == 2  # table hit


def test_a_failed_compile_is_raised_at_the_call(converted, monkeypatch):
    _, target = converted("llama3")
    exe = _executables(target)

    def broken(self, *args, **kwargs):
        raise RuntimeError("XLA ran out of memory compiling this step")

    monkeypatch.setattr(jax.stages.Lowered, "compile", broken)
    prefill, _ = exe.ar(1, 16, 64)
    with pytest.raises(RuntimeError, match="out of memory"):
        prefill(exe.target_params)
    with pytest.raises(RuntimeError, match="out of memory"):
        exe.ready()


def test_what_every_step_repeats_is_traced_once(converted, monkeypatch):
    """A run lowers its steps anew each time (the persistent cache keys on the lowered program), so
    what every step repeats (the drafter's call, the tree build, the lookup's chain) is a nested jit,
    traced once for all the steps of a shape rather than once in each of them."""
    from bastion_jax import lookup, tree_decoding
    from bastion_jax.checkpoints import random_drafter
    from bastion_jax.engine import Engine
    from bastion_jax.modeling.drafter import Drafter
    from bastion_jax.testing import tiny_drafter_config

    traces = {"drafter": 0, "tree": 0, "chain": 0}

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            traces[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(Drafter, "__call__", counting("drafter", Drafter.__call__))
    monkeypatch.setattr(tree_decoding, "build_tree", counting("tree", tree_decoding.build_tree))
    monkeypatch.setattr(lookup, "find_chain", counting("chain", lookup.find_chain))
    _, target = converted("llama3")
    drafter = random_drafter(tiny_drafter_config(target.config, block_size=4), seed=1)
    # Shapes no other test uses (buckets, tree width, cache length), so nothing is traced already.
    engine = Engine(target, drafter=drafter, stop_ids=[-1], buckets=(1, 3), top_k=3)
    exe = engine.executables
    _, steps = exe.tree(1, 16, 88, [1, 3])
    roots = exe.roots(1, 88)
    chains = exe.chains(1, 88)
    assert len(steps) + len(roots) + len(chains) >= 6  # 3 steps draft, all 6 look up a chain
    # The drafter: once for the prefill (nothing cached yet: other arguments) and once for the steps.
    assert traces == {"drafter": 2, "tree": 1, "chain": 1}


def test_parameters_are_one_pytree_node_holding_the_same_leaves(converted):
    """`FlatParams` is the nested dict the steps read (`nnx.merge` builds the model from it), handed
    to JAX as one node over the matrices, in the dict's order, and one packed vector per dtype of
    the rank <= 1 leaves: the same values after a round trip through a compiled call (every leaf,
    the packed ones sliced back apart), abstract values of the right shapes, and no change in place."""
    from flax import nnx

    from bastion_jax.executables import FlatParams

    _, target = converted("llama3")
    exe = _executables(target)
    plain = nnx.to_pure_dict(target.state)
    params = exe.target_params
    assert isinstance(params, FlatParams) and params == plain
    leaves, flat = jax.tree.leaves(params), jax.tree.leaves(plain)
    matrices = [x for x in flat if x.ndim > 1]
    small = [x for x in flat if x.ndim <= 1]
    assert small and jax.tree.structure(params).num_nodes == len(matrices) + 1 + 1  # one dtype: one vector
    for a, b in zip(leaves[:-1], matrices, strict=True):
        assert a is b
    np.testing.assert_array_equal(leaves[-1], np.concatenate([np.ravel(x) for x in small]))

    doubled = jax.jit(lambda p: jax.tree.map(lambda x: 2 * x, dict(p)))(params)  # every leaf, sliced apart inside
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(doubled), flat, strict=True):
        np.testing.assert_array_equal(a, 2 * b, err_msg=jax.tree_util.keystr(path))

    def norm_weight(p):
        return nnx.merge(target.graphdef, p).norm.weight[...] * 2

    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    assert jax.tree.map(lambda x: x.shape, dict(abstract)) == jax.tree.map(lambda x: x.shape, plain)
    np.testing.assert_array_equal(jax.jit(norm_weight).lower(abstract).compile()(params), 2 * plain["norm"]["weight"])
    for change in (lambda: params.__setitem__("norm", {}), lambda: params.update(norm={}), lambda: params.pop("norm")):
        with pytest.raises(TypeError, match="snapshot"):
            change()
    again = copy.deepcopy(params)
    assert isinstance(again, FlatParams) and jax.tree.structure(again) == jax.tree.structure(params)


def test_old_steps_are_dropped_before_the_mappings_run_out(converted):
    """XLA:CPU maps every kernel of a compiled step into the process, and Linux caps a process's
    mappings (a bastion process that had served four cache sizes aborted on its next compile): past
    `mapping_budget` the least recently used steps go first, their mappings with them, the engine no
    longer counts them warm, and a request that needs one again compiles it; every answer stays the
    target's greedy one."""
    from bastion_jax.checkpoints import random_drafter
    from bastion_jax.engine import Engine
    from bastion_jax.executables import mappings
    from bastion_jax.testing import tiny_drafter_config

    _, target = converted("qwen3")
    drafter = random_drafter(tiny_drafter_config(target.config, block_size=5), seed=2)
    engine = Engine(target, drafter=drafter, stop_ids=[-1], buckets=(1, 4), top_k=4)
    exe = engine.executables
    short, long = [5, 9, 11], [3 + i % 50 for i in range(150)]  # two cache lengths: two sets of steps
    ar = Engine(target, stop_ids=[-1])
    want = {len(p): ar.generate([p], max_new_tokens=8, mode="ar").tokens for p in (short, long)}
    assert engine.generate([short], max_new_tokens=8).tokens == want[len(short)]
    assert exe.evictions == 0 and exe.mapping_budget is not None and exe.mapping_budget > mappings()
    first = {id(e) for e in exe._table.values()}
    exe.mapping_budget = mappings() - 1  # any new step must make room first
    assert engine.generate([long], max_new_tokens=8).tokens == want[len(long)]
    gone = first - {id(e) for e in exe._table.values()}
    assert exe.evictions > 0 and gone  # the oldest went: the short prompt's steps
    assert not {(i, True) for i in gone} & engine.warm
    compiled = exe.compilations
    assert engine.generate([short], max_new_tokens=8).tokens == want[len(short)]
    assert exe.compilations > compiled  # compiled again
    held = mappings()
    exe.mapping_budget = 0
    exe.make_room()
    assert not exe._table and mappings() < held - 10 * exe.evictions  # dropping a step unmaps its kernels
