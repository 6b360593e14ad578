"""Would sampled drafts beat deterministic ones at T > 0? The drafter's acceptance both ways, measured.

    python -m benchmarks.sampled_drafts --prompts mt_bench gsm8k_test humaneval --max-prompts 8 --temperature 0.7

Why: at T > 0 our trees are deterministic (the drafter's top candidates) and verification samples
the target at every node and follows the child equal to the sample, so a node's children are
accepted with probability sum_c p_T(c), the target's tempered mass on them. That is the best any
exact rule can do for a fixed set of children. Sampled drafts verified by speculative sampling
(one draft: accept x ~ q with min(1, p/q), acceptance sum_x min(p, q)) or by recursive rejection
sampling over k draws without replacement (SpecInfer / Sequoia) can do better where q resembles
p_T: with q = p_T a single sampled draft is always accepted, a deterministic one only with max p_T.
Whether that pays depends on how close the drafter's law is to the target's tempered one, so this
measures it on the shipped pair rather than arguing it.

How: the target samples an answer at T per prompt (AR, seeded); at every one of the answer's first
`--max-new-tokens` positions a drafting call anchored there (the trainer's block construction, the
conditioned head given the true tokens before each slot, the tree's draft vocabulary) gives the
drafter's law q per block slot and the target's p_T for the same tokens. Per slot-1 position: the
deterministic top-k mass sum_{top k of q} p_T (k = 1, 2, 4, 8: the children a tree node offers),
speculative sampling's sum min(p_T, q) with q as it is and tempered like the target (q_T), recursive
rejection sampling with 2 and 4 draws from q_T (Monte Carlo), and max p_T (a perfect top-1 drafter).
Slots 2..`--depths` report top-1 and speculative sampling given the true tokens before them. Writes
benchmarks/results/<name>.json and .md with device, date and commit.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bastion_jax.acceptance import PromptError, read_prompts, resolve_prompt_file, set_name
from bastion_jax.checkpoints import CheckpointError, load_drafter, load_target
from bastion_jax.cli import fail
from bastion_jax.default_model import default_drafter_dir, default_target_dir
from bastion_jax.engine import Engine
from bastion_jax.sampling import SamplingConfig
from bastion_jax.shapes import next_pow2
from bastion_jax.text import encode_prompt, load_tokenizer
from bastion_jax.training.forward import anchored_forward, matmul
from bastion_jax.training.objective import Objective
from bastion_jax.training.step import features_step
from bastion_jax.training.vocab import lm_head_weight, load_ranking
from bastion_jax.training.walk import window_anchors
from benchmarks.report import commit, write_results

FIRST = ("top1", "top2", "top4", "top8", "spec", "spec_tempered", "rrs2", "rrs4", "max_p")


def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def top_mass(p: np.ndarray, q: np.ndarray, k: int) -> float:
    """sum of p over q's k most likely tokens: the acceptance of k fixed children (target samples at the node)."""
    return float(p[np.argsort(-q, kind="stable")[:k]].sum())


def spec_accept(p: np.ndarray, q: np.ndarray) -> float:
    """sum_x min(p, q): the acceptance of one draft x ~ q under speculative sampling."""
    return float(np.minimum(p, q).sum())


def rrs_accept(p: np.ndarray, q: np.ndarray, k: int, rng: np.random.Generator, trials: int) -> float:
    """Monte Carlo acceptance of recursive rejection sampling with k draws from q without replacement:
    draw x from what is left of q, accept with min(1, p'(x) / q'(x)), else p' <- norm(max(p' - q', 0)),
    remove x from q and try again (the output is an exact sample of p)."""
    hits = 0
    for _ in range(trials):
        pr, qr = p.astype(np.float64).copy(), q.astype(np.float64).copy()
        for _ in range(k):
            total = qr.sum()
            if total <= 0:
                break
            qn = qr / total
            x = rng.choice(len(qn), p=qn)
            if rng.random() * qn[x] < pr[x]:
                hits += 1
                break
            pr = np.maximum(pr - qn, 0.0)
            if pr.sum() <= 0:
                break
            pr /= pr.sum()
            qr[x] = 0.0
    return hits / trials


@partial(jax.jit, static_argnames=("drafter_def", "obj", "window", "depths", "hidden"))
def _laws(params, embed, head, ranked, tokens, loss_mask, features, *, drafter_def, obj, window: int, depths: int,
          hidden: int):
    """Drafter logits [b, W, depths, n_draft] over the draft vocabulary and target logits [b, W, depths, V]
    for slots 1..depths of the blocks at the first `window` response positions; valid [b, W]."""
    drafter = nnx.merge(drafter_def, params)
    anchors, valid = window_anchors(loss_mask, window)
    h, _ = anchored_forward(drafter, embed, features[..., :-hidden], tokens, loss_mask, anchors, valid, obj)
    q = matmul(h[:, :, :depths], head[ranked])  # [b, W, depths, n_draft]
    final = features[..., -hidden:]  # [b, S, h] the target's final normed states
    b, s = tokens.shape
    pos = jnp.minimum(anchors[:, :, None] + jnp.arange(depths), s - 1)  # [b, W, depths]: predicts the slot's token
    f = jnp.take_along_axis(final, pos.reshape(b, -1)[..., None], axis=1).reshape(*pos.shape, hidden)
    return q, matmul(f, head), valid


def measure_row(laws, answer: list[int], temperature: float, ranked: np.ndarray,
                rng: np.random.Generator, trials: int, every: int) -> tuple[dict, dict]:
    """Per-position figures of one sampled answer: slot 1's (FIRST) and deeper slots' (top1, spec)."""
    q_logits, p_logits, valid = laws
    first: dict[str, list[float]] = {k: [] for k in FIRST}
    deep: dict[str, list[float]] = {"top1": [], "spec": []}
    vocab = p_logits.shape[-1]
    for w in np.nonzero(valid)[0]:
        for d in range(q_logits.shape[1]):
            if w + d + 1 >= len(answer):  # the slot's token is past the answer
                continue
            p = softmax(p_logits[w, d] / temperature)
            q = np.zeros(vocab)
            q[ranked] = softmax(q_logits[w, d])
            if d:
                deep["top1"].append(top_mass(p, q, 1))
                deep["spec"].append(spec_accept(p, q))
                continue
            for k in (1, 2, 4, 8):
                first[f"top{k}"].append(top_mass(p, q, k))
            q_t = np.zeros(vocab)
            q_t[ranked] = softmax(q_logits[w, d] / temperature)
            first["spec"].append(spec_accept(p, q))
            first["spec_tempered"].append(spec_accept(p, q_t))
            first["max_p"].append(float(p.max()))
            if w % every == 0:  # Monte Carlo on a subset of positions, over q_t's top 256 (+ the rest of p)
                top = np.argsort(-q_t)[:256]
                pt, qt = np.append(p[top], max(0.0, 1 - p[top].sum())), np.append(q_t[top], 0.0)
                first["rrs2"].append(rrs_accept(pt, qt, 2, rng, trials))
                first["rrs4"].append(rrs_accept(pt, qt, 4, rng, trials))
    return first, deep


def main(argv=None) -> int:
    try:
        measure(argv)
    except (CheckpointError, PromptError, ValueError) as e:
        return fail(e)
    return 0


def measure(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", nargs="+", default=["mt_bench", "gsm8k_test", "humaneval"],
                    help="standard sets by name and/or JSONL(.gz) prompt files")
    ap.add_argument("--max-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--depths", type=int, default=4, help="block slots measured (slot 1 in full, the rest top-1 / spec)")
    ap.add_argument("--trials", type=int, default=100, help="Monte Carlo draws per position for recursive rejection")
    ap.add_argument("--every", type=int, default=4, help="recursive rejection at every N-th position")
    ap.add_argument("--name", default="cpu-smollm2-sampled-drafts")
    ap.add_argument("--out-dir", default="benchmarks/results")
    args = ap.parse_args(argv)
    if not args.temperature > 0:
        raise ValueError(f"--temperature must be > 0 (at 0 drafts are compared with the argmax), got {args.temperature}")
    paths = [resolve_prompt_file(spec) for spec in args.prompts]  # a wrong name fails before any loading
    target = load_target(default_target_dir(), jnp.float32)
    drafter = load_drafter(default_drafter_dir(), target.config, jnp.float32)
    tok = load_tokenizer(target)
    ranked = load_ranking(default_drafter_dir())[:8192]  # the tree's draft vocabulary (`--draft-vocab auto`)
    d, hidden = drafter.config, target.config.hidden_size
    taps = tuple(d.target_layer_ids) + (target.config.num_hidden_layers - 1,)  # + the final normed states
    obj = Objective(block_size=d.block_size, num_anchors=1, gamma=7.0, mask_token_id=d.mask_token_id)
    embed, head = target.state["embed_tokens"]["weight"][...], lm_head_weight(target)
    engine, rng = Engine(target, tok), np.random.default_rng(args.seed)
    sets: dict[str, dict] = {}
    for path in paths:
        prompts = [encode_prompt(tok, t) for t in read_prompts(path, args.max_prompts)]
        answers = engine.generate(prompts, mode="ar", max_new_tokens=args.max_new_tokens,
                                  sampling=SamplingConfig(args.temperature), seed=args.seed).tokens
        first: dict[str, list[float]] = {k: [] for k in FIRST}
        deep: dict[str, list[float]] = {"top1": [], "spec": []}
        for prompt, answer in zip(prompts, answers):
            seq = list(prompt) + list(answer)
            s = next_pow2(len(seq) + d.block_size)
            tokens = np.zeros((1, s), np.int32)
            tokens[0, :len(seq)] = seq
            mask = np.zeros((1, s), bool)
            mask[0, len(prompt):len(seq)] = True
            feats = features_step(target.state, jnp.asarray(tokens), target_def=target.graphdef, tap_layers=taps,
                                  cache_dtype=jnp.float32)
            q, p, valid = _laws(drafter.state, embed, head, jnp.asarray(ranked), jnp.asarray(tokens), jnp.asarray(mask),
                                feats, drafter_def=drafter.graphdef, obj=obj, window=args.max_new_tokens,
                                depths=args.depths, hidden=hidden)
            laws = (np.asarray(q[0], np.float64), np.asarray(p[0], np.float64), np.asarray(valid[0]))
            f, g = measure_row(laws, list(answer), args.temperature, ranked, rng, args.trials, args.every)
            for k in first:
                first[k] += f[k]
            for k in deep:
                deep[k] += g[k]
        sets[set_name(path)] = {"positions": len(first["top1"]), **{k: round(float(np.mean(v)), 3) for k, v in first.items()},
                                "deeper_top1": round(float(np.mean(deep["top1"])), 3),
                                "deeper_spec": round(float(np.mean(deep["spec"])), 3)}
    meta = {"device": jax.devices()[0].device_kind, "date": datetime.date.today().isoformat(), "commit": commit(),
            "temperature": args.temperature, "seed": args.seed, "max_new_tokens": args.max_new_tokens,
            "depths": args.depths, "prompts": args.prompts, "max_prompts": args.max_prompts, "trials": args.trials}
    cols = FIRST + ("deeper_top1", "deeper_spec")
    lines = [f"# Deterministic against sampled drafts at T = {args.temperature:g} ({meta['device']}, {meta['date']}, "
             f"commit {meta['commit']})", "",
             "Acceptance of the first drafted token after a root, per answer position (`python -m "
             "benchmarks.sampled_drafts`): topk = fixed children (our trees), spec / spec_tempered = one "
             "sampled draft from q / q_T, rrsK = K draws from q_T without replacement, max_p = a perfect "
             f"top-1 drafter; deeper = slots 2-{args.depths} given the true tokens before them.", "",
             "| set | positions | " + " | ".join(cols) + " |", "|---|---" + "|---" * len(cols) + "|"]
    for name, m in sets.items():
        lines.append(f"| {name} | {m['positions']} | " + " | ".join(f"{m[c]:.3f}" for c in cols) + " |")
    write_results(args.out_dir, args.name, {"meta": meta, "sets": sets}, "\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
