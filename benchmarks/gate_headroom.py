"""How much speed the draft gate leaves on the table: bastion's choices replayed against a hindsight oracle.

    python -m benchmarks.gate_headroom                       # default pair, 8 prompts per set
    python -m benchmarks.gate_headroom --drafter runs/v8/best --max-prompts 16 --name my-run
    python -m benchmarks.gate_headroom --save-tables runs/t.npz   # then replay other gates: load_tables

For every position t of each prompt's AR answer it drafts the tree bastion would draft at t and
measures how much of it verification would accept at each bucket, against the answer's known
continuation, so nothing is verified on the target. One target pass (the tapped features) and one
drafter pass with every position as a block anchor (`training.forward.drafter_blocks`, the same
drafter math as decoding) serve a whole answer. With the engine's calibrated step prices, policies
then replay on that table:

  ar         a plain AR step per token
  fixed:b    a tree of b nodes every step
  gate       bastion: `DraftGate` and the controller as `TreeLoop` runs them (draft or hold on root
             steps, verify or drop each tree, the bucket by estimated tokens/s), lookup off
  oracle     hindsight: dynamic programming over the same choices (hold, draft, verify bucket b,
             drop the tree) knowing every tree's outcome; an upper bound no causal policy reaches

Reported per prompt set: tau and the predicted tokens/s over AR. The context lookup is off (the
drafter's trees alone), and the table's acceptance agrees with the engine's fixed:b tau to within a
few % (the engine's drafter context comes from verify forwards, not one causal pass).

Sampling (`--temperature T`): the answers are the target's own samples at T, and the table reads them
as it reads greedy ones. The sampling adds no approximation: verification at T draws the target's
token at each node and walks down while the draw is a child (`tree_decoding`), so the text decoding
emits follows the target's autoregressive law at T, as an AR answer does, and the steps a policy
takes are a function of that text (which fixes the trees too): replaying them on one sampled answer
is one draw, in law, of what decoding at T does. The table's other approximations stay (the causal
drafter pass above; each answer replayed from a fresh gate, where the engine carries the gate's
memory across requests).
Writes benchmarks/results/<name>.json and .md with device, date and commit.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path
from typing import Callable

import numpy as np

from bastion_jax.acceptance import STANDARD_SETS, PromptError, read_prompts, resolve_prompt_file
from bastion_jax.cli import (add_cond_head_flags, check_cond_head, fail, head_setting_words, resolve_cond_head,
                             stderr_log)
from benchmarks.report import commit, write_results

RESULTS = Path(__file__).resolve().parent / "results"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gate_headroom", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", nargs="+", default=["gsm8k_test", "math500", "humaneval", "mbpp", "mt_bench"],
                   help=f"standard sets ({', '.join(STANDARD_SETS)}) or JSONL(.gz) files")
    p.add_argument("--max-prompts", type=int, default=8, help="prompts per set (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--drafter", help="drafter dir (default: the shipped drafter)")
    p.add_argument("--temperature", type=float, default=0.0, help="answers sampled at this temperature (default 0: "
                   "greedy); the tables then hold what decoding at T accepts (see above)")
    p.add_argument("--seed", type=int, default=0, help="the answers' sampling seed (T > 0)")
    add_cond_head_flags(p)
    p.add_argument("--buckets", default="1,4,8,16,32,64")
    p.add_argument("--fixed", default="4,8,16", help="fixed:N sizes to replay (must be buckets)")
    p.add_argument("--no-calibrate", action="store_true", help="price steps with a saved calibration or else the "
                   "roofline, profiling nothing (tau columns do not depend on prices)")
    p.add_argument("--recalibrate", action="store_true", help="profile the step prices now and save them over a "
                   "saved calibration (one taken on a busy machine skews every policy's replay)")
    p.add_argument("--name", help="results file name (default <backend>-smollm2-gate-headroom)")
    p.add_argument("--out-dir", default=str(RESULTS))
    p.add_argument("--save-tables", help="also write every answer's acceptance table and step prices to this .npz "
                   "(to replay other policies offline: `load_tables`)")
    p.add_argument("--quiet", action="store_true")
    return p


# -- the acceptance table ---------------------------------------------------------------------------

def pass_inputs(seq: np.ndarray, anchors: np.ndarray, slots: int):
    """(tokens [1, S], anchors [slots]) for a pass: the row padded to a multiple of 256 tokens and the
    anchors to `slots` (the last repeated), so that one compile serves rows of many lengths."""
    import jax.numpy as jnp

    padded = np.zeros(-(-len(seq) // 256) * 256, np.int32)
    padded[:len(seq)] = seq
    anc = np.full(slots, anchors[-1], np.int32)
    anc[:len(anchors)] = anchors
    return jnp.asarray(padded)[None], jnp.asarray(anc)


def acceptance_table(trees, buckets: tuple[int, ...], slots: int, prompt: list[int], answer: list[int]
                     ) -> tuple[np.ndarray, np.ndarray]:
    """(accepted [T, n_buckets], surrogate [T, n_buckets]) of the trees a decode step may verify, T =
    len(answer) - 1: row t is the tree rooted at answer[t] (the prefill emits answer[0], and each
    step's tree grows from the last committed token). `trees` is `tree_pass`'s function and `slots`
    the anchors it takes (at least T)."""
    import jax

    seq = np.asarray(prompt + answer, np.int32)
    n = len(answer) - 1
    anchors = np.arange(len(prompt), len(seq) - 1, dtype=np.int32)  # answer[t]'s position
    tree = trees(*pass_inputs(seq, anchors, max(n, slots)))
    tokens, parents, depths, log_probs = (np.asarray(x)[:n] for x in jax.device_get(
        (tree.tokens, tree.parents, tree.depths, tree.log_probs)))  # [T, nodes] each
    # Node j is accepted when its parent is and it equals the answer's token at its depth (parents
    # precede children in a best-first tree).
    cont = np.full((n, tokens.shape[1] + 1), -2, np.int64)
    for t in range(n):
        rest = seq[anchors[t] + 1:][: tokens.shape[1]]
        cont[t, :len(rest)] = rest
    ok = np.zeros(tokens.shape, bool)
    ok[:, 0] = True
    rows = np.arange(n)
    for j in range(1, tokens.shape[1]):
        want = cont[rows, np.maximum(depths[:, j] - 1, 0)]
        ok[:, j] = ok[rows, parents[:, j]] & (tokens[:, j] == want)
    accepted = np.stack([np.where(ok[:, :b], depths[:, :b], 0).max(axis=1) for b in buckets], axis=1)
    surrogate = np.stack([np.exp(log_probs[:, 1:b]).sum(axis=1) for b in buckets], axis=1)
    return accepted, surrogate


def hidden_pass(engine) -> tuple[Callable, object, object]:
    """A traceable function tokens [1, S], anchors [N] -> the drafter's hidden states [N, B-1, h] of the
    block anchored at each position (target features, then every block at once: the same drafter math
    as decoding), and the merged target and drafter modules it reads."""
    import jax.numpy as jnp
    from flax import nnx

    from bastion_jax.training.forward import drafter_blocks, target_features

    target, drafter = engine.target, engine.drafter
    tm, dm = nnx.merge(target.graphdef, target.state), nnx.merge(drafter.graphdef, drafter.state)
    cfg = drafter.config
    taps, block = tuple(cfg.target_layer_ids), cfg.block_size

    def hidden(tokens, anchors):  # tokens [1, S], anchors [N]
        feats = target_features(tm, tokens, taps, target.dtype)  # [1, S, F]
        k = jnp.arange(block)
        ids = jnp.where(k == 0, tokens[0, anchors][:, None], cfg.mask_token_id)  # [N, B]
        return drafter_blocks(dm, tm.embed_tokens(ids)[None], (anchors[:, None] + k)[None], anchors[None],
                              jnp.ones((1, anchors.shape[0]), bool), feats)[0, :, 1:]  # [N, B-1, h]

    return hidden, tm, dm


def lattice_pass(engine):
    """A traceable function tokens [1, S], anchors [N] -> the drafter's head-free log-distributions
    [N, B-1, draft vocab] of the block anchored at each position."""
    import jax

    from bastion_jax.speculative import head_logits

    hidden, tm, _ = hidden_pass(engine)
    return lambda tokens, anchors: jax.nn.log_softmax(head_logits(tm, hidden(tokens, anchors), engine.draft_vocab),
                                                      axis=-1)


def tree_pass(engine, transform=None, head: bool = True):
    """The jitted pass tokens [1, S], anchors [N] -> the best-first tree (engine.top_k wide, max bucket
    nodes) drafted at every anchor, as decoding drafts it: through the drafter's conditioned head where
    it has one (the spine, and depths 2 .. engine.cond_depths from each parent's own law, on
    engine.cond_candidates columns). `head` False: from the head-free laws (`lattice_pass`'s).
    `transform` (traceable, [N, B-1, V] -> same) rescores those head-free laws before the tree is built
    (an experiment's calibration, with `head=False` only)."""
    import jax

    from bastion_jax.speculative import block_laws, head_logits
    from bastion_jax.tree import build_tree
    from bastion_jax.tree_decoding import draft_trees

    hidden, tm, dm = hidden_pass(engine)
    vocab, nodes = engine.draft_vocab, max(engine.buckets)
    ids_map = vocab.ids if vocab is not None else None
    with_head = head and dm.cond_head is not None
    if with_head and transform is not None:
        raise ValueError("a transform rescores the head-free laws: pass head=False with it")
    depths = engine.cond_depths if with_head and engine.cond_depths >= 2 else 0

    @jax.jit
    def trees(tokens, anchors):  # tokens [1, S], anchors [N]
        roots = tokens[0, anchors]  # [N]
        h = hidden(tokens, anchors)  # [N, B-1, h]
        if with_head:  # each anchor is a row, as a batch of rows drafts
            logits, law = block_laws(tm, dm.cond_head, h, roots, vocab, cond_candidates=engine.cond_candidates)
            return draft_trees(tuple(engine.buckets), engine.top_k, depths, roots, logits, ids_map, None,
                               law if depths else None)[0]
        base = head_logits(tm, h, vocab)  # [N, B-1, vocab or N]
        lp = jax.nn.log_softmax(base, axis=-1)
        if transform is not None:
            lp = transform(lp)
        return jax.vmap(lambda r, l: build_tree(r, l, nodes, engine.top_k, ids_map))(roots, lp)

    return trees


# -- policies replayed on the table ----------------------------------------------------------------

def replay_fixed(acc, prices, b_index) -> tuple[float, int]:
    """(seconds, steps) of fixed:b over one answer."""
    t, secs, steps = 0, 0.0, 0
    while t < len(acc):
        secs += prices.tree(b_index, t)
        steps += 1
        t += int(acc[t, b_index]) + 1
    return secs, steps


def replay_gate(acc, sur, prices, engine) -> tuple[float, int]:
    """(seconds, steps) of bastion's choices: `TreeLoop._dispatch_next` without the lookup."""
    from bastion_jax.controller import Controller, Policy
    from bastion_jax.draft_gate import DraftGate
    from bastion_jax.tree_decoding import DRAFT, HOLD, pending_slots

    buckets, latency = engine.buckets, prices.latency
    gate = DraftGate(buckets, latency.step_time, pending_slots(engine.block_size), engine.block_size)
    ctl = Controller(Policy("bastion"), buckets, latency)
    one = np.ones(1, bool)
    t, secs, steps, holding = 0, 0.0, 0, False
    gate.observe_tree(sur[0])
    while t < len(acc):
        c = prices.context(t)
        steps += 1
        if not holding:
            b = ctl.choose(sur[t][None] * gate.rho, c, one, record=False) if gate.use_tree(c, sur[t]) else 1
            if b != 1:
                i = buckets.index(b)
                secs += prices.tree(i, t)
                gate.observe_verify(buckets[i], float(sur[t, i]), float(acc[t, i]))
                gate.record(DRAFT, int(acc[t, i]) + 1)
                t += int(acc[t, i]) + 1
                if t < len(acc):
                    gate.observe_tree(sur[t])
                continue
        then = gate.root_then(c, None)
        secs += prices.root(then != HOLD, t)  # a flush runs the drafter over the held tokens too
        gate.record(then, 1)
        t += 1
        holding = then != DRAFT
        if not holding and t < len(acc):
            gate.observe_tree(sur[t])
    return secs, steps


def replay_oracle(acc, prices) -> float:
    """Seconds of the best sequence of choices in hindsight (a tree is in hand after a drafting step)."""
    n, nb = acc.shape
    hold = np.zeros(n + 1)  # seconds to finish from t holding no tree
    tree = np.zeros(n + 1)  # ... with the tree drafted at t in hand
    for t in range(n - 1, -1, -1):
        hold[t] = min(prices.root(False, t) + hold[t + 1], prices.root(True, t) + tree[t + 1])
        tree[t] = min([hold[t]] + [prices.tree(i, t) + tree[min(t + int(acc[t, i]) + 1, n)] for i in range(1, nb)])
    return float(tree[0])


class Prices:
    """Step seconds from the engine's latency model at the context of answer position t."""

    def __init__(self, latency, buckets, prompt_len: int):
        self.latency, self.buckets, self.prompt_len = latency, buckets, prompt_len

    def context(self, t: int) -> int:
        return self.prompt_len + 1 + t  # row t's root is answer[t]

    def root(self, draft: bool, t: int) -> float:
        return self.latency.step_time(0, self.context(t), draft)

    def tree(self, i: int, t: int) -> float:
        b = self.buckets[i]
        return self.root(True, t) if b == 1 else self.latency.step_time(b, self.context(t), True)


class TablePrices(Prices):
    """`Prices` read back from a saved table: step_time(b, c, draft) at the answer's contexts only."""

    def __init__(self, times: np.ndarray, buckets, prompt_len: int):  # times [T, 1 + n_buckets, 2]
        self.times, self.buckets, self.prompt_len = times, tuple(int(b) for b in buckets), prompt_len
        self.latency = self
        self._col = {b: i + 1 for i, b in enumerate(self.buckets)} | {0: 0}

    def step_time(self, b: int, c: int, draft: bool) -> float:
        return float(self.times[c - self.prompt_len - 1, self._col[b], int(draft)])

    def predict(self, b: int, c: int) -> float:
        return self.step_time(b, c, True)


def table_record(acc: np.ndarray, sur: np.ndarray, prices: Prices) -> dict[str, np.ndarray]:
    """One answer's table and the step prices at each of its positions (`TablePrices` reads them)."""
    lat = prices.latency
    times = np.array([[[lat.step_time(b, prices.context(t), d) for d in (False, True)]
                       for b in (0,) + tuple(prices.buckets)] for t in range(len(acc))])  # [T, 1 + n_buckets, 2]
    return {"acc": acc, "sur": sur, "times": times, "prompt_len": np.asarray(prices.prompt_len)}


def save_tables(path, buckets: tuple[int, ...], records: dict[str, dict[str, np.ndarray]]) -> None:
    """`table_record`s by "set/k" into one .npz (`load_tables` reads it back)."""
    np.savez_compressed(path, buckets=np.asarray(buckets), **{
        f"{key}:{field}": v for key, rec in records.items() for field, v in rec.items()})


def load_tables(path) -> tuple[tuple[int, ...], dict[str, tuple[np.ndarray, np.ndarray, TablePrices]]]:
    """(buckets, {"set/k": (accepted, surrogate, prices)}) from `--save-tables`."""
    z = np.load(path)
    buckets = tuple(int(b) for b in z["buckets"])
    keys = sorted({k.rsplit(":", 1)[0] for k in z.files if ":" in k})
    return buckets, {k: (z[f"{k}:acc"], z[f"{k}:sur"], TablePrices(z[f"{k}:times"], buckets, int(z[f"{k}:prompt_len"])))
                     for k in keys}


# -- main -------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    log = stderr_log(args.quiet)
    from bastion_jax import default_drafter_dir, default_target_dir
    from bastion_jax.calibration import calibration_model, load_or_calibrate
    from bastion_jax.checkpoints import CheckpointError, load_drafter, load_target
    from bastion_jax.controller import PolicyError, parse_buckets
    from bastion_jax.engine import Engine, GenerationError
    from bastion_jax.sampling import SamplingConfig
    from bastion_jax.speculative import resolve_draft_vocab
    from bastion_jax.text import encode_prompt, load_tokenizer

    try:
        buckets = parse_buckets(args.buckets)
        if args.save_tables and not Path(args.save_tables).resolve().parent.is_dir():
            raise ValueError(f"--save-tables {args.save_tables}: no such directory to write it in")
        fixed = [int(x) for x in args.fixed.split(",") if x.strip()]
        sampling = SamplingConfig(temperature=args.temperature)
        if not set(fixed) <= set(buckets):
            raise PolicyError(f"--fixed {args.fixed}: every size must be one of --buckets {args.buckets}")
        target = load_target(default_target_dir(verbose=not args.quiet))
        drafter = load_drafter(args.drafter or default_drafter_dir(), target.config, target.dtype,
                               cond_head=resolve_cond_head(args.cond_head))
        check_cond_head(args.cond_head, drafter)
        tokenizer = load_tokenizer(target)
        engine = Engine(target, tokenizer, drafter=drafter, buckets=buckets, lookup=None,
                        draft_vocab=resolve_draft_vocab(target, drafter, "auto"), cond_depths=args.cond_depths,
                        cond_candidates=args.cond_candidates)
        model = calibration_model(target, drafter, engine.draft_vocab, lookup=False, cond_depths=engine.cond_depths,
                                  cond_candidates=engine.cond_candidates)
        load_or_calibrate(engine, model, 1024, sampling, args.no_calibrate, log, refresh=args.recalibrate,
                          progress=not args.quiet)
        trees = tree_pass(engine)
        sets = {Path(resolve_prompt_file(s)).name.split(".")[0]: read_prompts(resolve_prompt_file(s), args.max_prompts)
                for s in args.prompts}
    except (CheckpointError, PolicyError, PromptError, GenerationError, ValueError) as e:
        return fail(e)

    policies = ["ar"] + [f"fixed:{b}" for b in fixed] + ["gate", "oracle"]
    report: dict[str, dict[str, dict[str, float]]] = {}
    saved: dict[str, dict[str, np.ndarray]] = {}
    for name, texts in sets.items():
        ids = [encode_prompt(tokenizer, p) for p in texts]
        answers = engine.generate(ids, max_new_tokens=args.max_new_tokens, mode="ar", sampling=sampling,
                                  seed=args.seed).tokens
        tot = {p: [0.0, 0] for p in policies}  # seconds, steps
        tokens = 0
        for k, (prompt, answer) in enumerate(zip(ids, answers)):
            if len(answer) < 2:
                continue
            acc, sur = acceptance_table(trees, buckets, args.max_new_tokens, prompt, answer)
            prices = Prices(engine.latency, buckets, len(prompt))
            if args.save_tables:
                saved[f"{name}/{k}"] = table_record(acc, sur, prices)
            runs = {"ar": (sum(prices.root(False, t) for t in range(len(acc))), len(acc)),
                    "gate": replay_gate(acc, sur, prices, engine),
                    "oracle": (replay_oracle(acc, prices), 0)}
            runs.update({f"fixed:{b}": replay_fixed(acc, prices, buckets.index(b)) for b in fixed})
            for p, (secs, steps) in runs.items():
                tot[p][0] += secs
                tot[p][1] += steps
            tokens += len(acc)  # (answer[0] comes from the prefill under every policy)
        report[name] = {p: {"tau": tokens / s if s else float("nan"), "speed_over_ar": tot["ar"][0] / secs}
                        for p, (secs, s) in tot.items()}
        log(f"{name}: " + ", ".join(f"{p} {r['speed_over_ar']:.2f}x" for p, r in report[name].items()))

    meta = {"device": str(__import__("jax").devices()[0].device_kind), "date": datetime.date.today().isoformat(),
            "commit": commit(), "drafter": str(args.drafter or "shipped"), "max_prompts": args.max_prompts,
            "max_new_tokens": args.max_new_tokens, "buckets": list(buckets), "temperature": args.temperature,
            "seed": args.seed, "cond_head": head_setting_words(engine) or "none", "cond_depths": engine.cond_depths,
            "cond_candidates": engine.cond_candidates}
    name = args.name or f"{__import__('jax').default_backend()}-smollm2-gate-headroom"
    lines = [f"# {name}", "", f"{meta['device']}, {meta['date']}, commit {meta['commit']}, drafter {meta['drafter']}, "
             f"{args.max_prompts} prompts per set, {args.max_new_tokens} new tokens, T={args.temperature:g}"
             + (f" (seed {args.seed})" if args.temperature else "") + f", lookup off, conditioned head: "
             f"{meta['cond_head']}. Predicted "
             "tokens/s over AR from the calibrated step prices (tau in brackets; the oracle's tau is not a step "
             "count).", "", "| set | " + " | ".join(policies) + " |", "|---" * (len(policies) + 1) + "|"]
    for set_name, rows in report.items():
        lines.append(f"| {set_name} | " + " | ".join(
            f"{rows[p]['speed_over_ar']:.2f}" + (f" ({rows[p]['tau']:.2f})" if p != "oracle" else "")
            for p in policies) + " |")
    if args.save_tables:
        save_tables(args.save_tables, buckets, saved)
        log(f"wrote {len(saved)} tables to {args.save_tables}")
    write_results(args.out_dir, name, {"meta": meta, "sets": report}, "\n".join(lines), args.quiet)
    return 0


if __name__ == "__main__":
    sys.exit(main())
