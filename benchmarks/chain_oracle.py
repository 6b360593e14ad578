"""What one lookup chain per step leaves behind: the context chain, the datastore chain, the one
that promises more (what `LookupConfig(tree_chains=1)` offers a drafted tree, and what a step that
does not draft holds by default), and a hindsight choice of the two.

    python -m benchmarks.chain_oracle --prompts gsm8k_test humaneval mt_bench --max-prompts 8

The context's chain is the continuation of the latest earlier occurrence of the text's last 1-4
tokens, the datastore's the majority continuation of the text's last 1-8 tokens in target-written
text; the one offered alone is the one that promises more accepted tokens by the classes' prior hit
rates. At every position of each prompt's AR greedy answer this measures how many tokens each
chain would have got right (no drafter, nothing verified: the answer is known), the one offered,
and the better of the two in hindsight: the most a tree holding both chains (the default,
`tree_chains=2`) can add over one, before the drafter's own candidates cover part of it.
Positions, not a decoding walk: a loop in an answer counts at each of its positions. The priors are
the untrained ones (a request's own outcomes move them in decoding, `lookup.probabilities`). Writes
benchmarks/results/<name>.json and .md with device, date and commit.
"""

from __future__ import annotations

import argparse
import datetime
import sys

import jax
import jax.numpy as jnp
import numpy as np

from bastion_jax.acceptance import PromptError, read_prompts, resolve_prompt_file, set_name
from bastion_jax.checkpoints import CheckpointError, load_target
from bastion_jax.cli import fail
from bastion_jax.datastore import NUM_CLASSES, DatastoreError, load_datastore, store_chain
from bastion_jax.default_model import default_drafter_dir, default_target_dir
from bastion_jax.engine import Engine
from bastion_jax.lookup import LookupConfig, LookupState, current_chain, find_chain, primary
from bastion_jax.text import encode_prompt, load_tokenizer
from benchmarks.report import commit, write_results

COLUMNS = ("context", "datastore", "offered", "best of two")


def runs(chain: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """[n] how many leading tokens of each chain [n, depth] equal the known continuation [n, depth]
    (-1 in either: no token)."""
    ok = (chain == truth) & (chain >= 0)
    return np.cumprod(ok, axis=1).sum(axis=1)


def answer_table(cfg: LookupConfig, store, prompt: list[int], answer: list[int], depth: int) -> np.ndarray:
    """[positions, 4] tokens right per position of the answer: context, datastore, offered, best."""
    text = np.asarray(prompt + answer, np.int32)
    n = len(answer) - 1  # roots: answer[0 .. n-1], each followed by a known token
    roots = np.arange(len(prompt), len(prompt) + n)
    hist = np.where(np.arange(len(text))[None, :] <= roots[:, None], text[None, :], 0)  # [n, L] the text so far
    # A fresh request's lookup state at every root (no outcomes counted: the prior rates)
    state = LookupState(jnp.asarray(hist), jnp.full((n, depth), -1, jnp.int32), jnp.zeros((n,), jnp.int32),
                        jnp.zeros((n, cfg.max_ngram + NUM_CLASSES, 4), jnp.float32))
    root_pos = jnp.asarray(roots, jnp.int32)
    offered = primary(current_chain(cfg, state, root_pos, store)).tokens  # [n, depth] the one chain offered
    c = jax.vmap(lambda h, r: find_chain(cfg, h, r, depth).tokens)(state.history, root_pos)
    s = jax.vmap(lambda h, r: store_chain(store, h, r, depth)[0])(state.history, root_pos)
    c, s, offered = jax.device_get((c, s, offered))
    truth = np.full((n, depth), -2, np.int64)
    for i in range(n):
        nxt = answer[i + 1:i + 1 + depth]
        truth[i, :len(nxt)] = nxt
    rc, rs = runs(c, truth), runs(s, truth)
    return np.stack([rc, rs, runs(offered, truth), np.maximum(rc, rs)], axis=1)


def main(argv=None) -> int:
    try:
        measure(argv)
    except (CheckpointError, DatastoreError, PromptError) as e:
        return fail(e)
    return 0


def measure(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", nargs="+", default=["gsm8k_test", "math500", "humaneval", "mbpp", "mt_bench"],
                    help="standard sets by name and/or JSONL(.gz) prompt files")
    ap.add_argument("--max-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--depth", type=int, default=15, help="chain length (the default drafter's block size - 1)")
    ap.add_argument("--name", default="cpu-smollm2-chain-oracle")
    ap.add_argument("--out-dir", default="benchmarks/results")
    args = ap.parse_args(argv)
    paths = [resolve_prompt_file(spec) for spec in args.prompts]  # a wrong name fails before any loading
    target = load_target(default_target_dir())
    tok = load_tokenizer(target)
    engine = Engine(target, tok)
    store = load_datastore(default_drafter_dir() / "datastore.npz", target.config.vocab_size)
    cfg = LookupConfig()
    sets: dict[str, np.ndarray] = {}
    for path in paths:
        prompts = [encode_prompt(tok, t) for t in read_prompts(path, args.max_prompts)]
        answers = engine.generate(prompts, max_new_tokens=args.max_new_tokens, mode="ar").tokens
        sets[set_name(path)] = np.concatenate([answer_table(cfg, store, list(p), list(a), args.depth)
                                               for p, a in zip(prompts, answers) if len(a) > 1])
    sets["all"] = np.concatenate(list(sets.values()))
    means = {name: dict(zip(COLUMNS, t.mean(axis=0).round(3).tolist()), positions=len(t)) for name, t in sets.items()}
    meta = {"device": jax.devices()[0].device_kind, "date": datetime.date.today().isoformat(), "commit": commit(),
            "max_new_tokens": args.max_new_tokens, "depth": args.depth, "prompts": args.prompts,
            "max_prompts": args.max_prompts}
    lines = [f"# Lookup chains: one offered against the better of two ({meta['device']}, {meta['date']}, "
             f"commit {meta['commit']})", "",
             f"Mean tokens right per answer position (AR greedy answers, {args.max_new_tokens} new tokens, "
             f"chains of {args.depth}; `python -m benchmarks.chain_oracle`).", "",
             "| set | positions | " + " | ".join(COLUMNS) + " |", "|---|---" + "|---" * len(COLUMNS) + "|"]
    for name, m in means.items():
        lines.append(f"| {name} | {m['positions']} | " + " | ".join(f"{m[c]:.3f}" for c in COLUMNS) + " |")
    write_results(args.out_dir, args.name, {"meta": meta, "sets": means}, "\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
