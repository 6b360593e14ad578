"""Are the drafter's marginals calibrated acceptance rates? A reliability table and a calibration A/B.

    python -m benchmarks.marginal_calibration                   # shipped drafter, 120 greedy training rows
    python -m benchmarks.marginal_calibration --drafter runs/x/best --fit-rows 300 --max-prompts 16

BASTION scores a tree node by the product of the drafter's per-depth marginals along its path and
takes the sum over the nodes as the expected accepted length. What a node is worth, though, is its
chance of acceptance given that its parent was accepted, and a block-diffusion drafter's marginal at
depth d is not conditioned on the tokens above it. Where the two differ, trees are the wrong shape
(too wide or too deep) and the surrogate misprices them. This measures the gap and what closing it
is worth:

1. reliability, on target-written greedy rows (a packed training file: default the shipped drafter's
   `greedy.npz`): for every anchor and depth d whose greedy tokens at depths < d all are among the
   drafter's top K (so the parent is a node of a large enough tree), the top-1 token's mean marginal
   against how often it is the greedy token, and the top-K mass against how often any is;
2. per-depth Platt scaling, q = sigmoid(a_d logit(p) + b_d), fitted (scipy) on those candidates:
   monotone within a depth, so it changes only how depths trade against each other and the
   surrogate's scale;
3. on AR answers of evaluation prompts (T = 0, lookup off, as `benchmarks.gate_headroom` builds its
   tables, from the drafter's head-free laws in both arms, since those are what is calibrated): the
   tree's accepted length at each bucket with raw and with calibrated scores, and the surrogate over
   what was accepted.

Writes benchmarks/results/<name>.json and .md with device, date and commit.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import numpy as np

from bastion_jax.acceptance import STANDARD_SETS, PromptError, read_prompts, resolve_prompt_file
from bastion_jax.cli import fail, stderr_log
from benchmarks.report import commit, write_results

RESULTS = Path(__file__).resolve().parent / "results"
FIT_DATA = Path(__file__).resolve().parents[1] / "training_data" / "smollm2-135m-instruct" / "greedy.npz"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.marginal_calibration", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", help="drafter dir (default: the shipped drafter)")
    p.add_argument("--fit-data", default=str(FIT_DATA), help="packed token file of target-written rows "
                   "(its temperature-0 rows are used)")
    p.add_argument("--fit-rows", type=int, default=120, help="rows to fit on (default 120)")
    p.add_argument("--top-k", type=int, default=32, help="candidates per depth in the reliability table and the fit")
    p.add_argument("--prompts", nargs="+", default=["gsm8k_test", "math500", "humaneval", "mbpp", "mt_bench"],
                   help=f"standard sets ({', '.join(STANDARD_SETS)}) or JSONL(.gz) files")
    p.add_argument("--max-prompts", type=int, default=8, help="prompts per set (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--buckets", default="1,4,8,16,32,64")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", help="results file name (default <backend>-smollm2-marginal-calibration)")
    p.add_argument("--out-dir", default=str(RESULTS))
    p.add_argument("--quiet", action="store_true")
    return p


# -- the conditional events -------------------------------------------------------------------------

def conditional_candidates(top_lp: np.ndarray, top_ids: np.ndarray, truth: np.ndarray
                           ) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per depth d (0-based), (log-probs [n_d * K], hits [n_d * K]) of the top-K candidates of the
    anchors whose greedy tokens at depths < d are all among their depth's top K.

    top_lp, top_ids: [N, D, K] the drafter's top-K per depth of N anchors; truth: [N, D] the greedy
    tokens that follow each anchor. A hit is a candidate equal to the greedy token at its depth: given
    its parent was accepted, that node is accepted."""
    hit = top_ids == truth[:, :, None]  # [N, D, K]
    found = hit.any(axis=2)  # [N, D]
    parent_on_text = np.logical_and.accumulate(np.concatenate([np.ones_like(found[:, :1]), found[:, :-1]], axis=1),
                                               axis=1)  # [N, D]
    return [(top_lp[on, d].ravel(), hit[on, d].ravel()) for d, on in enumerate(parent_on_text.T)]


def _logit(lp, xp=np):
    """log(p / (1 - p)) from log p (clipped away from 0 and 1); xp: numpy or jax.numpy."""
    lp = xp.clip(lp, -30.0, -1e-6)
    return lp - xp.log(-xp.expm1(lp))


def fit_platt(lp: np.ndarray, hit: np.ndarray) -> tuple[float, float]:
    """(a, b) of P(hit) = sigmoid(a logit(p) + b), by maximum likelihood (scipy's L-BFGS)."""
    from scipy.optimize import minimize
    from scipy.special import expit, log_expit

    x, y = _logit(np.asarray(lp, np.float64)), np.asarray(hit, np.float64)

    def nll(w):
        z = w[0] * x + w[1]
        p = expit(z)
        return -(y * log_expit(z) + (1 - y) * log_expit(-z)).mean(), np.array([((p - y) * x).mean(), (p - y).mean()])

    res = minimize(nll, np.array([1.0, 0.0]), jac=True, method="L-BFGS-B")
    return float(res.x[0]), float(res.x[1])


def platt(cal):
    """The traceable lattice transform log q = log sigmoid(a_d logit(p) + b_d); cal [D, 2] rows (a, b)."""
    import jax
    import jax.numpy as jnp

    cal = jnp.asarray(cal, jnp.float32)

    def transform(lp):  # [N, D, V]
        return jax.nn.log_sigmoid(cal[:, 0][:, None] * _logit(lp, jnp) + cal[:, 1][:, None])

    return transform


# -- main -------------------------------------------------------------------------------------------

def _fit_rows(path: str, n: int, seed: int) -> list[tuple[int, np.ndarray]]:
    """(prompt length, prompt + response ids up to 512 tokens) of `n` temperature-0 rows drawn with `seed`."""
    from bastion_jax.training.data import read_packed

    rows = [r for r in read_packed(path) if r["temperature"] == 0.0]
    if not rows:
        raise ValueError(f"--fit-data {path}: no temperature-0 rows")
    pick = np.random.default_rng(seed).choice(len(rows), min(n, len(rows)), replace=False)
    return [(len(rows[i]["prompt_ids"]), np.asarray(rows[i]["prompt_ids"] + rows[i]["response_ids"], np.int32)[:512])
            for i in pick]


def reliability(engine, rows, k: int, log) -> list[tuple[np.ndarray, np.ndarray]]:
    """`conditional_candidates` pooled over the rows' response anchors (chunks of 256 anchors)."""
    import jax

    from benchmarks.gate_headroom import lattice_pass, pass_inputs

    lattice = lattice_pass(engine)
    ids_map = engine.draft_vocab.ids if engine.draft_vocab is not None else None

    @jax.jit
    def top(tokens, anchors):
        v, i = jax.lax.top_k(lattice(tokens, anchors), k)  # [N, D, k]
        return v, (i if ids_map is None else ids_map[i])

    depth = engine.block_size - 1
    pooled: list[list] = [[[], []] for _ in range(depth)]
    for j, (plen, seq) in enumerate(rows):
        anchors = np.arange(plen, len(seq) - depth, dtype=np.int32)
        for c in range(0, len(anchors), 256):
            a = anchors[c:c + 256]
            v, ids = (np.asarray(x)[:len(a)] for x in top(*pass_inputs(seq, a, 256)))
            truth = np.stack([seq[a + d] for d in range(1, depth + 1)], axis=1)  # [n, D]
            for d, (lp, hit) in enumerate(conditional_candidates(v, ids, truth)):
                pooled[d][0].append(lp)
                pooled[d][1].append(hit)
        if (j + 1) % 20 == 0:
            log(f"fit rows: {j + 1}/{len(rows)}")
    return [(np.concatenate(lp), np.concatenate(hit)) for lp, hit in pooled]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    log = stderr_log(args.quiet)
    from bastion_jax import default_drafter_dir, default_target_dir
    from bastion_jax.checkpoints import CheckpointError, load_drafter, load_target
    from bastion_jax.controller import PolicyError, parse_buckets
    from bastion_jax.engine import Engine, GenerationError
    from bastion_jax.speculative import resolve_draft_vocab
    from bastion_jax.text import encode_prompt, load_tokenizer
    from bastion_jax.training.data import DataError
    from benchmarks.gate_headroom import acceptance_table, tree_pass

    try:
        buckets = parse_buckets(args.buckets)
        rows = _fit_rows(args.fit_data, args.fit_rows, args.seed)
        target = load_target(default_target_dir(verbose=not args.quiet))
        drafter = load_drafter(args.drafter or default_drafter_dir(), target.config, target.dtype)
        tokenizer = load_tokenizer(target)
        engine = Engine(target, tokenizer, drafter=drafter, buckets=buckets, lookup=None,
                        draft_vocab=resolve_draft_vocab(target, drafter, "auto"))
        sets = {Path(resolve_prompt_file(s)).name.split(".")[0]: read_prompts(resolve_prompt_file(s), args.max_prompts)
                for s in args.prompts}
    except (CheckpointError, PolicyError, PromptError, GenerationError, DataError, ValueError) as e:
        return fail(e)

    cands = reliability(engine, rows, args.top_k, log)
    depth_rows, cal = [], np.zeros((len(cands), 2))
    for d, (lp, hit) in enumerate(cands):
        cal[d] = fit_platt(lp, hit)
        top_lp, top_hit = lp.reshape(-1, args.top_k), hit.reshape(-1, args.top_k)
        depth_rows.append({"depth": d + 1, "anchors": len(top_lp), "top1_p": float(np.exp(top_lp[:, 0]).mean()),
                           "top1_hit": float(top_hit[:, 0].mean()), "topk_p": float(np.exp(top_lp).sum(1).mean()),
                           "topk_hit": float(top_hit.any(1).mean()), "a": cal[d, 0], "b": cal[d, 1]})

    passes = {"raw": tree_pass(engine, head=False), "calibrated": tree_pass(engine, platt(cal), head=False)}
    report: dict[str, dict[str, dict[str, list[float]]]] = {}
    for name, texts in sets.items():
        ids = [encode_prompt(tokenizer, p) for p in texts]
        answers = engine.generate(ids, max_new_tokens=args.max_new_tokens, mode="ar").tokens
        report[name] = {}
        for key, trees in passes.items():
            acc_sum, sur_sum, n = np.zeros(len(buckets)), np.zeros(len(buckets)), 0
            for prompt, answer in zip(ids, answers):
                if len(answer) < 2:
                    continue
                acc, sur = acceptance_table(trees, buckets, args.max_new_tokens, prompt, answer)
                acc_sum, sur_sum, n = acc_sum + acc.sum(0), sur_sum + sur.sum(0), n + len(acc)
            report[name][key] = {"tau": (1 + acc_sum / max(n, 1)).tolist(),
                                 "surrogate_over_accepted": (sur_sum / np.maximum(acc_sum, 1e-9)).tolist()}
        log(f"{name}: tau at b={buckets[-1]} raw {report[name]['raw']['tau'][-1]:.3f}, "
            f"calibrated {report[name]['calibrated']['tau'][-1]:.3f}")

    meta = {"device": str(__import__("jax").devices()[0].device_kind), "date": datetime.date.today().isoformat(),
            "commit": commit(), "drafter": str(args.drafter or "shipped"), "fit_data": str(args.fit_data),
            "fit_rows": len(rows), "top_k": args.top_k, "max_prompts": args.max_prompts,
            "max_new_tokens": args.max_new_tokens, "buckets": list(buckets)}
    name = args.name or f"{__import__('jax').default_backend()}-smollm2-marginal-calibration"
    lines = [f"# {name}", "", f"{meta['device']}, {meta['date']}, commit {meta['commit']}, drafter {meta['drafter']}; "
             f"fitted on {len(rows)} temperature-0 rows of `{Path(args.fit_data).name}`, top {args.top_k} per depth.",
             "", "Reliability (anchors whose greedy tokens above depth d are all in the top K) and the Platt fit:", "",
             "| depth | anchors | top-1 marginal | top-1 hit | top-K mass | any hit | a | b |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['depth']} | {r['anchors']} | {r['top1_p']:.3f} | {r['top1_hit']:.3f} | {r['topk_p']:.3f} | "
              f"{r['topk_hit']:.3f} | {r['a']:.3f} | {r['b']:.3f} |" for r in depth_rows]
    lines += ["", f"Trees on AR answers ({args.max_prompts} prompts per set, {args.max_new_tokens} new tokens, T=0, "
              "lookup off): tau (1 + accepted) per bucket, raw / calibrated scores, and the surrogate over the "
              "accepted length.", "", "| set | scores | " + " | ".join(f"b={b}" for b in buckets) + " | surrogate / "
              f"accepted at b={buckets[-1]} |", "|---" * (len(buckets) + 3) + "|"]
    for set_name, by in report.items():
        for key, r in by.items():
            lines.append(f"| {set_name} | {key} | " + " | ".join(f"{t:.3f}" for t in r["tau"])
                         + f" | {r['surrogate_over_accepted'][-1]:.2f} |")
    write_results(args.out_dir, name, {"meta": meta, "depths": depth_rows, "sets": report}, "\n".join(lines),
                  args.quiet)
    return 0


if __name__ == "__main__":
    sys.exit(main())
