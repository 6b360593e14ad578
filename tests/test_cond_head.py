"""The drafter's optional parent-conditioned head: its laws against brute force, its files, and
decoding with it token-identical to AR (a head changes drafts, never output)."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bastion_jax.checkpoints import CheckpointError, LoadedDrafter, convert, load_drafter, random_drafter
from bastion_jax.checkpoints.dflash import export_zlab
from bastion_jax.engine import Engine
from bastion_jax.modeling.cache import KVCache
from bastion_jax.modeling.cond_head import (child_log_probs, embed_table, head_law, head_tables, root_state,
                                             spine_logits)
from bastion_jax.speculative import DraftVocab, draft_logits, head_logits
from bastion_jax.testing import tiny_drafter_config

BLOCK = 4


def with_head(drafter: LoadedDrafter, rank: int, seed: int, scale: float = 1.0, recurrent: bool = False
              ) -> LoadedDrafter:
    """`drafter` plus a conditioned head of `rank` with random weights (fc2 and `rec` too: a trained head)."""
    cfg = dataclasses.replace(drafter.config, cond_head_rank=rank, cond_head_recurrent=recurrent)
    grown = random_drafter(cfg, seed=seed)
    pure = nnx.to_pure_dict(grown.state)
    pure.update({k: v for k, v in nnx.to_pure_dict(drafter.state).items()})
    keys = jax.random.split(jax.random.key(seed), 3)
    head = pure["cond_head"]
    h = cfg.hidden_size
    head["fc1"]["weight"] = jax.random.normal(keys[0], (rank, 2 * h)) * scale * (2 * h) ** -0.5
    head["fc1"]["bias"] = jax.random.normal(keys[1], (rank,)) * scale
    head["fc2"]["weight"] = jax.random.normal(keys[2], (h, rank)) * scale
    if recurrent:
        head["rec"]["weight"] = jax.random.normal(jax.random.fold_in(keys[0], 1), (rank, rank)) * scale * rank ** -0.5
    nnx.replace_by_pure_dict(grown.state, pure)
    return LoadedDrafter(cfg, grown.graphdef, grown.state)


@pytest.fixture(scope="module")
def pair(converted):
    _, target = converted("qwen3")
    return target, random_drafter(tiny_drafter_config(target.config, num_layers=2, block_size=BLOCK), seed=3)


def test_a_new_head_drafts_exactly_as_the_drafter(pair):
    """fc2 starts at zero: a freshly added head is the drafter without one, to the bit."""
    target, drafter = pair
    grown = random_drafter(dataclasses.replace(drafter.config, cond_head_rank=8), seed=9)
    pure = nnx.to_pure_dict(grown.state)
    pure.update(nnx.to_pure_dict(drafter.state))  # same drafter weights, the head as initialised
    nnx.replace_by_pure_dict(grown.state, pure)
    assert not np.any(np.asarray(pure["cond_head"]["fc2"]["weight"]))
    outs = []
    for d in (drafter, grown):
        cache = KVCache.create(d.config, 1, 32, jnp.float32)
        feats = jax.random.normal(jax.random.key(0), (1, 8, len(d.config.target_layer_ids) * target.config.hidden_size))
        logits, _ = draft_logits(nnx.merge(target.graphdef, target.state), nnx.merge(d.graphdef, d.state), cache, feats, None, jnp.array([8]),
                                 jnp.array([5]), block_size=BLOCK, mask_token_id=d.config.mask_token_id, proposal=None)
        outs.append(np.asarray(logits))
    np.testing.assert_array_equal(outs[0], outs[1])


@pytest.mark.parametrize("reduced,recurrent", [(False, False), (True, False), (False, True), (True, True)])
def test_spine_logits_match_brute_force(pair, reduced, recurrent):
    """Slot 1's law given the root, slot k's given slot k-1's argmax: the head run slot by slot on
    the full hidden state (z = h + fc2 u, u = silu(fc1 [h; e] + rec u_prev)) equals the low-rank
    table form."""
    loaded, drafter = pair
    grown = with_head(drafter, 6, seed=4, recurrent=recurrent)
    head = nnx.merge(grown.graphdef, grown.state).cond_head
    target = nnx.merge(loaded.graphdef, loaded.state)
    b, depth, h = 3, BLOCK - 1, target.config.hidden_size
    hidden = jax.random.normal(jax.random.key(1), (b, depth, h))
    root = jnp.array([3, 17, 40])
    vocab = DraftVocab.from_ranking(loaded, np.random.default_rng(0).permutation(target.config.vocab_size), 40) \
        if reduced else None
    lm = (lambda x: head_logits(target, x, vocab))
    law = head_law(head, hidden, lm(hidden), head_tables(head, lm, target.embed_tokens.weight[...]))
    got = spine_logits(law, root, vocab.ids if reduced else None)
    emb = np.asarray(loaded.state["embed_tokens"]["weight"][...])
    for r in range(b):
        prev, u = int(root[r]), None
        for k in range(depth):
            z, u = head(hidden[r, k], jnp.asarray(emb[prev]), u)  # [h], [rank]
            want = np.asarray(lm(z[None]))[0]
            np.testing.assert_allclose(np.asarray(got[r, k]), want, rtol=1e-4, atol=1e-4)
            best = int(np.argmax(want))
            prev = int(vocab.ids[best]) if reduced else best
    assert not np.allclose(np.asarray(got), np.asarray(lm(hidden)), atol=1e-2)  # the head does change the laws
    # A tree's per-parent law: slot k given each of several parents and the states their parents
    # handed down, as the head run on the full state.
    parents = jnp.array([0, 7, 40, 95])
    states = jax.random.normal(jax.random.key(5), (4, 6))
    row = law._replace(a=law.a[1], base=law.base[1])
    for k in range(depth):
        got_k, cols, got_u = child_log_probs(row, k, parents, states)  # [4, N], None (every column), [4, rank]
        assert cols is None
        for i, p in enumerate(np.asarray(parents)):
            z, u = head(hidden[1, k], jnp.asarray(emb[p]), states[i])
            np.testing.assert_allclose(np.asarray(got_k[i]), np.asarray(jax.nn.log_softmax(lm(z[None])[0])),
                                       rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(np.asarray(got_u[i]), np.asarray(u), rtol=1e-4, atol=1e-5)
        # the states matter exactly when the head is recurrent
        assert np.allclose(np.asarray(child_log_probs(row, k, parents, 0 * states)[0]), np.asarray(got_k),
                           atol=1e-6) != recurrent


@pytest.mark.parametrize("recurrent,reduced,m", [(False, False, 5), (True, True, 5), (True, False, 2)])
def test_candidate_laws_match_brute_force(pair, recurrent, reduced, m):
    """With candidates, each slot's M best head-free columns carry the head's conditioned logits and
    every other column its head-free one: the spine drafts the argmax of that mixed row (a candidate,
    or the best other column where it beats them all), and a tree parent's law is the candidates'
    log-probs under the mixed row (its normaliser counting the other columns' head-free mass), all
    as the head run slot by slot on the full hidden state."""
    loaded, drafter = pair
    grown = with_head(drafter, 6, seed=4, scale=3.0, recurrent=recurrent)
    head = nnx.merge(grown.graphdef, grown.state).cond_head
    target = nnx.merge(loaded.graphdef, loaded.state)
    b, depth, h = 2, BLOCK - 1, target.config.hidden_size
    hidden = jax.random.normal(jax.random.key(1), (b, depth, h))
    root = jnp.array([3, 17])
    vocab = DraftVocab.from_ranking(loaded, np.random.default_rng(0).permutation(target.config.vocab_size), 40) \
        if reduced else None
    ids = np.asarray(vocab.ids) if reduced else np.arange(target.config.vocab_size)
    lm = (lambda x: head_logits(target, x, vocab))
    base = lm(hidden)
    embed = target.embed_tokens.weight[...]
    law = head_law(head, hidden, base, head_tables(head, lm, embed), candidates=m)
    assert head_law(head, hidden, base, head_tables(head, lm, embed), candidates=base.shape[-1]).cols is None
    got = np.asarray(spine_logits(law, root, vocab.ids if reduced else None))
    emb = np.asarray(loaded.state["embed_tokens"]["weight"][...])
    base_np = np.asarray(base)
    changed, outside = False, 0
    for r in range(b):
        prev, u = int(root[r]), None
        for k in range(depth):
            cols = np.argsort(-base_np[r, k], kind="stable")[:m]
            np.testing.assert_array_equal(np.sort(np.asarray(law.cols[r, k])), np.sort(cols))
            z, u = head(hidden[r, k], jnp.asarray(emb[prev]), u)
            want = base_np[r, k].copy()
            want[cols] = np.asarray(lm(z[None]))[0][cols]
            np.testing.assert_allclose(got[r, k], want, rtol=1e-4, atol=1e-4)
            changed |= int(np.argmax(want)) != int(np.argmax(base_np[r, k]))
            outside += int(np.argmax(want)) not in cols
            prev = int(ids[np.argmax(want)])  # the next slot is conditioned on the row's own argmax
    assert changed  # (the head re-ranks the candidates here)
    assert outside > 0 or m > 2  # on 2 candidates the best other column wins some slots: that path runs
    # A tree parent's law over the candidates of slot k.
    parents = jnp.array([0, 7, 40])
    states = jax.random.normal(jax.random.key(5), (3, 6))
    row = law._replace(a=law.a[1], base=law.base[1], cols=law.cols[1], table_c=law.table_c[1], base_c=law.base_c[1],
                       tail=law.tail[1], out=law.out[1], out_col=law.out_col[1])
    for k in range(depth):
        lp, cols, _ = child_log_probs(row, k, parents, states)  # [3, m], [m]
        assert lp.shape == (3, m) and np.all(np.isfinite(np.asarray(lp)))
        np.testing.assert_array_equal(np.asarray(cols), np.asarray(law.cols[1, k]))
        for i, p in enumerate(np.asarray(parents)):
            z, _ = head(hidden[1, k], jnp.asarray(emb[p]), states[i])
            full = base_np[1, k].copy()
            full[np.asarray(cols)] = np.asarray(lm(z[None]))[0][np.asarray(cols)]
            want = full[np.asarray(cols)] - np.log(np.sum(np.exp(full - full.max()))) - full.max()
            np.testing.assert_allclose(np.asarray(lp[i]), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decoding_with_a_head_equals_ar(pair, dtype, tmp_path):
    """dflash, fixed trees and bastion through a (random, strong, recurrent) head, with a reduced draft
    vocabulary and without, emit exactly the AR tokens."""
    from bastion_jax.checkpoints import load_target

    target, drafter = pair
    if dtype != jnp.float32:
        target = load_target(target.path, dtype)
    grown = with_head(drafter, 8, seed=5, scale=3.0, recurrent=True)
    d = LoadedDrafter(grown.config, grown.graphdef, jax.tree.map(lambda a: a.astype(dtype), grown.state))
    prompts = [[5, 9, 11, 40], [7, 7, 8, 30, 31, 2]]
    ranking = np.random.default_rng(1).permutation(target.config.vocab_size)
    cases = ((None, 0, 0), (DraftVocab.from_ranking(target, ranking, 48), 0, 0),
             (DraftVocab.from_ranking(target, ranking, 48), 3, 0),
             (DraftVocab.from_ranking(target, ranking, 48), 3, 6))  # the head on 6 candidates per slot
    for vocab, cond_depths, candidates in cases:
        engine = Engine(target, drafter=d, stop_ids=[-1], buckets=(1, 4, 8), top_k=4, draft_vocab=vocab,
                        cond_depths=cond_depths, cond_candidates=candidates)
        assert engine.executables.config().cond_candidates == candidates
        if vocab is not None:
            assert engine.draft_vocab.cond_tables is not None  # made once, not in every step
        # the chain drafts over every token: its tables are made once too, and bound to its steps
        prefill, step = engine.executables.chain(2, 8, 64)
        assert step.bound[1].logits.shape == step.bound[1].embed.shape == (target.config.vocab_size, 8)
        assert step.bound[1] is prefill.bound[1]
        if vocab is not None:  # one embedding table for the chain's and the trees' steps
            assert step.bound[1].embed is engine.draft_vocab.cond_tables.embed
        ar = engine.generate(prompts, max_new_tokens=24, mode="ar").tokens
        modes = ("dflash", "fixed:4", "bastion") if cond_depths == 0 else ("fixed:8", "bastion")
        modes += ("dflash",) if candidates else ()  # the chain's spine over the full vocabulary's candidates
        for mode in modes:
            assert engine.generate(prompts, max_new_tokens=24, mode=mode).tokens == ar, (mode, vocab is None)


def test_cond_depths_are_checked(pair):
    target, drafter = pair
    with pytest.raises(Exception, match="none is loaded .*unless --cond-head off"):
        Engine(target, drafter=drafter, stop_ids=[-1], cond_depths=3)
    # auto: depths 2-4, capped at the block's last depth (this block has 4 slots: depths 1-3)
    assert Engine(target, drafter=with_head(drafter, 6, seed=6), stop_ids=[-1]).cond_depths == 3
    with pytest.raises(Exception, match=r"cond_depths must be in \[0, block size - 1 = 3\], got 4"):
        Engine(target, drafter=with_head(drafter, 4, seed=0), stop_ids=[-1], cond_depths=4)
    with pytest.raises(Exception, match=r"cond_candidates must be >= 0"):
        Engine(target, drafter=with_head(drafter, 4, seed=0), stop_ids=[-1], cond_candidates=-1)
    with pytest.raises(Exception, match="cond_candidates restricts a conditioned head; none is loaded"):
        Engine(target, drafter=drafter, stop_ids=[-1], cond_candidates=8)
    assert Engine(target, drafter=drafter, stop_ids=[-1]).cond_candidates == 0  # auto without a head: nothing to restrict


def test_head_files_round_trip_and_refusals(pair, tmp_path, capsys):
    target, drafter = pair
    grown = with_head(drafter, 6, seed=6)
    out = export_zlab(grown.config, grown.state, tmp_path / "d", jnp.float32, info={"steps": 3})
    meta = json.loads((out / "cond_head.json").read_text())
    assert meta["rank"] == 6 and meta["steps"] == 3
    assert "cond_head" not in json.dumps(json.loads((out / "config.json").read_text()))  # z-lab config untouched
    from safetensors.numpy import load_file

    assert not any(k.startswith("cond_head") for k in load_file(str(out / "model.safetensors")))
    assert not capsys.readouterr().err  # (the head's file is not read as a shard of the drafter)
    back = load_drafter(out, target.config, jnp.float32, cond_head=True)
    assert back.config.cond_head_rank == 6
    # loaded unless told otherwise, on every backend (drafter v17's head pays on CPU too)
    assert load_drafter(out, target.config, jnp.float32).config.cond_head_rank == 6
    assert load_drafter(out, target.config, jnp.float32, cond_head=False).config.cond_head_rank == 0
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(back.state), nnx.to_pure_dict(grown.state))
    assert load_drafter(out, target.config, jnp.float32, cond_head=False).config.cond_head_rank == 0
    # converting the z-lab dir to our format keeps the head beside it
    conv = convert(out, tmp_path / "conv", dtype="float32")
    again = load_drafter(conv, target.config, jnp.float32, cond_head=True)
    assert "unused tensor" not in capsys.readouterr().err
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(again.state), nnx.to_pure_dict(grown.state))

    # a head beside another drafter (same shapes) is refused, not used to draft worse
    import shutil

    other = export_zlab(drafter.config, random_drafter(drafter.config, seed=12).state, tmp_path / "other", jnp.float32)
    for name in ("cond_head.json", "cond_head.safetensors"):
        shutil.copy(out / name, other / name)
    with pytest.raises(CheckpointError, match="trained on another drafter's hidden states"):
        load_drafter(other, target.config, jnp.float32, cond_head=True)
    assert load_drafter(other, target.config, jnp.float32, cond_head=False).config.cond_head_rank == 0

    meta_bad = dict(meta, hidden_size=meta["hidden_size"] + 1)
    (out / "cond_head.json").write_text(json.dumps(meta_bad))
    with pytest.raises(CheckpointError, match="does not fit this drafter"):
        load_drafter(out, target.config, jnp.float32, cond_head=True)
    (out / "cond_head.json").write_text(json.dumps(dict(meta, rank=5)))
    with pytest.raises(CheckpointError, match=r"fc1.weight has shape \(6, 128\), expected \(5, 128\)"):
        load_drafter(out, target.config, jnp.float32, cond_head=True)
    (out / "cond_head.json").write_text(json.dumps(meta))
    (out / "cond_head.safetensors").write_bytes(b"\x00" * 20)
    with pytest.raises(CheckpointError, match="corrupt conditioned-head weights"):
        load_drafter(out, target.config, jnp.float32, cond_head=True)
    # a recurrent head round-trips with its `rec`; a config that disowns it, or a bad flag, is refused
    rec = with_head(drafter, 6, seed=7, recurrent=True)
    export_zlab(rec.config, rec.state, out, jnp.float32)
    meta_rec = json.loads((out / "cond_head.json").read_text())
    assert meta_rec["recurrent"] is True
    back = load_drafter(out, target.config, jnp.float32, cond_head=True)
    assert back.config.cond_head_recurrent and back.config.cond_head_rank == 6
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(back.state), nnx.to_pure_dict(rec.state))
    (out / "cond_head.json").write_text(json.dumps(dict(meta_rec, recurrent=False)))
    with pytest.raises(CheckpointError, match=r"holds \['fc1.bias', 'fc1.weight', 'fc2.weight', 'rec.weight'\]"):
        load_drafter(out, target.config, jnp.float32, cond_head=True)
    (out / "cond_head.json").write_text(json.dumps(dict(meta_rec, recurrent="yes")))
    with pytest.raises(CheckpointError, match="recurrent must be true or false"):
        load_drafter(out, target.config, jnp.float32, cond_head=True)
    # a drafter without a head exported over the directory leaves no stale head behind
    export_zlab(drafter.config, drafter.state, out, jnp.float32)
    assert not (out / "cond_head.json").exists() and load_drafter(out, target.config).config.cond_head_rank == 0


@pytest.mark.parametrize("recurrent", [False, True])
def test_a_head_trained_on_a_frozen_drafter_walks_as_decoding_does(pair, tmp_path, recurrent):
    """`--cond-head R --freeze-drafter`: only the head moves; the trainer's teacher-forced walk (each
    slot given the true token before it) takes, row by row, exactly the steps dflash decoding through
    the exported head takes (drafting given the drafted token before it), and the head earns acceptance."""
    from bastion_jax.training import (Objective, TokenDataset, TrainConfig, Trainer, add_head, loss_vocab,
                                      target_features, walk, walk_runs)

    target, drafter = pair
    rng = np.random.default_rng(3)
    prompts = [list(rng.integers(4, 90, 4)) for _ in range(24)]
    out = Engine(target, stop_ids=[-1]).generate(prompts, max_new_tokens=28).tokens
    data = TokenDataset([{"prompt_ids": [int(t) for t in p], "response_ids": o} for p, o in zip(prompts, out)],
                        seq_len=32, vocab_size=target.config.vocab_size)
    train, val = data.split(4)
    with pytest.raises(ValueError, match="conditioned head, and it has none"):
        Trainer(target, drafter, TrainConfig(steps=1, seq_len=32, num_anchors=8, freeze_drafter=True), tmp_path)
    grown = add_head(drafter, 16, seed=1, recurrent=recurrent)
    cfg = TrainConfig(steps=80, batch_size=4, seq_len=32, num_anchors=8, lr=3e-2, eval_every=20,
                      freeze_drafter=True)
    trained = Trainer(target, grown, cfg, tmp_path / "run", log=lambda m: None).fit(train, val, progress=False)
    before, after = nnx.to_pure_dict(grown.state), nnx.to_pure_dict(trained.state)
    before.pop("cond_head")
    head_after = after.pop("cond_head")
    jax.tree.map(np.testing.assert_array_equal, after, before)  # the drafter did not move (no decay either)
    assert np.abs(np.asarray(head_after["fc2"]["weight"])).max() > 1e-3  # the head did
    assert ("rec" in head_after) == recurrent
    if recurrent:
        assert np.abs(np.asarray(head_after["rec"]["weight"])).max() > 1e-3

    loaded = load_drafter(export_zlab(trained.config, trained.state, tmp_path / "export", jnp.float32), target.config,
                          cond_head=True)
    assert loaded.config.cond_head_rank == 16 and loaded.config.cond_head_recurrent == recurrent
    engine = Engine(target, drafter=loaded, stop_ids=[-1], cond_candidates=0)  # the walk conditions every column
    plain = Engine(target, drafter=drafter, stop_ids=[-1])
    assert engine.generate(prompts[:4], max_new_tokens=20, mode="dflash").tokens == \
        Engine(target, stop_ids=[-1]).generate(prompts[:4], max_new_tokens=20).tokens
    # The walk over rows it trained on (the tiny random target's continuations of random prompts share
    # little, so a head this small learns its rows, not a rule; enough to check the two agree).
    rows = train.tokens[:8], train.loss_mask[:8]
    model = nnx.merge(target.graphdef, target.state)
    tokens, mask = jnp.asarray(rows[0]), jnp.asarray(rows[1])
    obj = Objective(block_size=BLOCK, num_anchors=8, gamma=7.0, mask_token_id=drafter.config.mask_token_id)
    run, valid = walk_runs(trained.state, loss_vocab(target, None, 0), model.embed_tokens.weight[...],
                           target_features(model, tokens, drafter.config.target_layer_ids, jnp.float32), tokens,
                           mask, drafter_def=trained.graphdef, obj=obj, window=40, matmul_dtype="float32")
    taus = []
    for e in (engine, plain):
        committed = steps = 0
        for i in range(len(rows[0])):
            start, length = int(np.argmax(rows[1][i])), int(rows[1][i].sum())
            st = e.generate([[int(t) for t in rows[0][i, :start]]], max_new_tokens=length, mode="dflash").stats
            if e is engine:
                assert walk(np.asarray(run[i:i + 1]), np.asarray(valid[i:i + 1])) == (st.new_tokens - 1, st.steps)
            committed, steps = committed + st.new_tokens - 1, steps + st.steps
        taus.append(committed / steps)
    assert taus[0] > taus[1] + 0.1, taus  # the head drafts what the frozen random drafter could not


@pytest.mark.parametrize("recurrent", [False, True])
def test_a_steps_tree_takes_each_parents_own_law(pair, recurrent):
    """`tree_decoding.draft_trees` with a head's law and cond_depths 3: the nodes and scores of enumerating
    every path whose depth-2..3 children come from the parent's own law (the head run per parent, a
    recurrent one along the whole path from the root)."""
    from test_tree import node_paths, per_parent_brute_force

    from bastion_jax.tree_decoding import draft_trees

    loaded, drafter = pair
    grown = with_head(drafter, 6, seed=8, scale=3.0, recurrent=recurrent)
    head = nnx.merge(grown.graphdef, grown.state).cond_head
    target = nnx.merge(loaded.graphdef, loaded.state)
    depth = BLOCK - 1
    hidden = jax.random.normal(jax.random.key(2), (2, depth, loaded.config.hidden_size))
    lm = (lambda x: head_logits(target, x))
    law = head_law(head, hidden, lm(hidden), head_tables(head, lm, target.embed_tokens.weight[...]))
    law = law._replace(embed=law.embed * 300.0)  # (the tiny target's embeddings are small: make parents matter)
    root = jnp.array([3, 50])
    logits = spine_logits(law, root, None)
    n, top_k = 9, 2
    tree, _ = draft_trees((1, 4, n), top_k, 3, root, logits, None, None, law)
    plain, _ = draft_trees((1, 4, n), top_k, 0, root, logits, None, None, None)
    differs = []
    for r in range(2):
        row = law._replace(a=law.a[r], base=law.base[r])

        def path_law(d, path, row=row, root=int(root[r])):  # the law of the children of path's last token
            u = root_state(row, jnp.int32(root))[None]  # [1, rank]
            for i, t in enumerate(path):
                lp, _, u = child_log_probs(row, i + 1, jnp.array([t]), u)
            return np.asarray(lp[0])

        shared = np.asarray(jax.nn.log_softmax(logits[r], axis=-1))
        ref = per_parent_brute_force(int(root[r]), shared, path_law, 3, n - 1, top_k)
        one = jax.tree.map(lambda x: x[r], tree)
        assert node_paths(one) == [p for _, p in ref]
        np.testing.assert_allclose(np.asarray(one.log_probs)[1:], [s for s, _ in ref], rtol=1e-4, atol=1e-4)
        differs.append(node_paths(one) != node_paths(jax.tree.map(lambda x: x[r], plain)))
    assert any(differs)  # (the laws matter here)


def test_a_frozen_drafters_steps_skip_its_backward_pass_only(pair, tmp_path, monkeypatch):
    """`--freeze-drafter` differentiates the head alone (`train_step(head_only=True)`): the same head
    updates as differentiating every weight and zeroing the drafter's, the drafter's weights as given."""
    from bastion_jax.training import TokenDataset, TrainConfig, Trainer, add_head
    from bastion_jax.training import trainer as trainer_module

    target, drafter = pair
    rng = np.random.default_rng(4)
    rows = [{"prompt_ids": [int(t) for t in rng.integers(4, 90, 4)],
             "response_ids": [int(t) for t in rng.integers(4, 90, 20)]} for _ in range(12)]
    train, val = TokenDataset(rows, seq_len=32, vocab_size=target.config.vocab_size).split(4)
    cfg = TrainConfig(steps=3, batch_size=4, seq_len=32, num_anchors=8, lr=1e-2, eval_every=100, walk_rows=0,
                      freeze_drafter=True)
    grown = add_head(drafter, 8, seed=2, recurrent=True)
    runs, flags, real = [], [], trainer_module.train_step
    for head_only in (True, False):
        def step(*a, _real=real, _head_only=head_only, **k):
            flags.append(k["head_only"])
            return _real(*a, **dict(k, head_only=_head_only))

        monkeypatch.setattr(trainer_module, "train_step", step)
        runs.append(nnx.to_pure_dict(Trainer(target, grown, cfg, tmp_path / str(head_only), log=lambda m: None)
                                     .fit(train, val, progress=False).state))
    assert flags == [True] * 6  # the trainer asks for the head alone when the drafter is frozen
    fast, full = runs
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), fast, full)
    before = nnx.to_pure_dict(grown.state)
    assert not np.allclose(fast["cond_head"]["rec"]["weight"], before["cond_head"]["rec"]["weight"])
    fast.pop("cond_head"), before.pop("cond_head")
    jax.tree.map(np.testing.assert_array_equal, fast, before)


def test_the_marginal_weight_adds_the_drafters_own_loss(pair, tmp_path):
    """`--marginal W` (a head trained with its drafter): the loss is the conditioned law's plus W times
    the drafter's own (the same drafter without the head, same anchors), validation walks both, and a
    frozen drafter or a headless one refuses it."""
    from bastion_jax.training import Objective, TokenDataset, TrainConfig, Trainer, loss_vocab, target_features
    from bastion_jax.training.forward import anchored_forward
    from bastion_jax.training.step import eval_step
    from bastion_jax.training.walk import window_anchors

    target, drafter = pair
    headed = with_head(drafter, 8, seed=5, recurrent=True)
    rng = np.random.default_rng(5)
    rows = [{"prompt_ids": [int(t) for t in rng.integers(4, 90, 4)],
             "response_ids": [int(t) for t in rng.integers(4, 90, 24)]} for _ in range(8)]
    data = TokenDataset(rows, seq_len=32, vocab_size=target.config.vocab_size)
    model = nnx.merge(target.graphdef, target.state)
    tokens, mask = jnp.asarray(data.tokens), jnp.asarray(data.loss_mask)
    features = target_features(model, tokens, drafter.config.target_layer_ids, jnp.float32)
    vocab, embed, key = loss_vocab(target, None, 0), model.embed_tokens.weight[...], jax.random.key(0)

    def loss(d, marginal):
        obj = Objective(block_size=BLOCK, num_anchors=8, gamma=7.0, mask_token_id=drafter.config.mask_token_id,
                        marginal=marginal)
        return float(eval_step(d.state, vocab, embed, features, tokens, mask, key, drafter_def=d.graphdef,
                               obj=obj, matmul_dtype="float32").loss)

    cond, own = loss(headed, 0.0), loss(drafter, 0.0)
    assert abs(cond - own) > 1e-3  # the head changes the law
    np.testing.assert_allclose(loss(headed, 0.5), cond + 0.5 * own, rtol=1e-5)
    np.testing.assert_allclose(loss(drafter, 0.5), own, rtol=1e-6)  # nothing to add without a head

    train, val = data.split(4)
    cfg = TrainConfig(steps=1, batch_size=4, seq_len=32, num_anchors=8, walk_window=20, marginal=0.5)
    ev = Trainer(target, headed, cfg, tmp_path / "a", log=lambda m: None).evaluate(headed.state, val)
    plain = Trainer(target, drafter, dataclasses.replace(cfg, marginal=0.0), tmp_path / "b",
                    log=lambda m: None).evaluate(drafter.state, val)
    assert ev["walk_tau_own"] == plain["walk_tau"] and "walk_tau_own" not in plain
    # what that walk reads: the headed drafter's states before its head are the plain drafter's
    anchors, valid = window_anchors(mask, 20)
    obj = Objective(block_size=BLOCK, num_anchors=8, gamma=7.0, mask_token_id=drafter.config.mask_token_id)
    states = {(d is headed, c): anchored_forward(nnx.merge(d.graphdef, d.state), embed, features, tokens, mask,
                                                 anchors, valid, obj, condition=c)[0]
              for d in (headed, drafter) for c in (True, False)}
    np.testing.assert_array_equal(states[True, False], states[False, True])
    assert not np.allclose(states[True, True], states[False, True], atol=1e-3)
    for d, c in ((drafter, cfg), (headed, dataclasses.replace(cfg, freeze_drafter=True))):
        with pytest.raises(ValueError, match="--marginal weighs the drafter's own law"):
            Trainer(target, d, c, tmp_path / "c")


def test_embed_table_is_each_tokens_product(pair):
    """`embed_table`'s row x is fc1's embedding columns times token x's embedding, what the head's
    state adds for a previous token x (the table replaces that product in the step)."""
    target, drafter = pair
    grown = with_head(drafter, 6, seed=2)
    head = nnx.merge(grown.graphdef, grown.state).cond_head
    embed = target.state["embed_tokens"]["weight"][...]
    got = np.asarray(embed_table(head, embed))
    w_e = np.asarray(head.split_fc1()[1], np.float64)  # [rank, h]
    assert got.dtype == np.float32 and got.shape == (embed.shape[0], 6)
    np.testing.assert_allclose(got, np.asarray(embed, np.float64) @ w_e.T, rtol=1e-5, atol=1e-6)


def test_bf16_tree_step_gathers_the_embedding_in_place(pair):
    """A bf16 tree step with per-parent depths carries no [V, h] table through its loops: gathering
    the parents' bf16 embeddings inside the depth loop made XLA:CPU hoist a converted (later a
    16-bit) copy of the whole table out of the loop and carry it, every step (~19 ms of a SmolLM2
    bf16 tree step). The head now gathers rows of its float32 `embed_table`."""
    from bastion_jax.checkpoints import load_target

    target, drafter = pair
    target = load_target(target.path, jnp.bfloat16)
    grown = with_head(drafter, 8, seed=5, recurrent=True)
    d = LoadedDrafter(grown.config, grown.graphdef, jax.tree.map(lambda a: a.astype(jnp.bfloat16), grown.state))
    engine = Engine(target, drafter=d, stop_ids=[-1], buckets=(1, 8), top_k=4, cond_depths=3, cond_candidates=0)
    _, steps = engine.executables.tree(1, 8, 64, [8])
    hlo = steps[8].exe.result().as_text()
    whole = f"[{target.config.vocab_size},{target.config.hidden_size}]"
    loops = [line.split(" while(")[0] for line in hlo.splitlines() if " while(" in line]
    assert loops and not [carried for carried in loops if whole in carried]
