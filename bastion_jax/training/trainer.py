"""Drafter training's host loop: a resumable `Trainer` around the jitted steps of `step.py`.

The loop feeds batches (target features computed once per row and kept in a `FeatureStore`), sets
the learning rate from the schedule, keeps the weights' moving average and each row's misses (what
the next visit's anchors prefer), validates along the decoding walk, checkpoints with orbax and
exports the best step.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import time
from functools import partial
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from bastion_jax.checkpoints import LoadedDrafter, Target
from bastion_jax.trace_report import StepTracer
from bastion_jax.training.data import TokenDataset, batch_indices
from bastion_jax.training.features import FeatureStore, target_fingerprint
from bastion_jax.training.objective import Metrics, Objective, default_gamma
from bastion_jax.training.optim import TrainConfig, learning_rate, optimizer, set_learning_rate
from bastion_jax.training.step import ema_update, eval_step, features_step, misses_step, train_step
from bastion_jax.training.vocab import LossVocab, load_ranking, loss_vocab, rank_vocab, save_ranking
from bastion_jax.training.walk import rows_per_call, walk, walk_runs


# Held-out rows the teacher-forced validation reads, whatever the batch size (`Trainer.evaluate`).
VAL_ROWS = 128


def _copy(tree):
    return jax.tree.map(lambda a: jnp.array(a, copy=True), tree)


def _mean(metrics: list[Metrics]) -> dict[str, float]:
    """Weight-averaged metrics over several batches (batches without trainable blocks count 0)."""
    w = np.array([float(m.weight) for m in metrics])
    total = max(w.sum(), 1e-9)
    return {f: float(sum(float(getattr(m, f)) * wi for m, wi in zip(metrics, w)) / total)
            for f in ("loss", "acc_first", "accept_len")}


def response_tokens(data: TokenDataset) -> list[np.ndarray]:
    """The response tokens of every row (what the target wrote): the text a vocabulary ranking counts."""
    return [t[m] for t, m in zip(data.tokens, data.loss_mask)]


@dataclasses.dataclass
class Trainer:
    """Trains `drafter` against a frozen `target` on `train`; resumable through an orbax CheckpointManager.

    `workdir/checkpoints` holds the latest steps (params + optimizer state); `workdir/metrics.jsonl`
    logs training and validation metrics and throughput; `workdir/vocab_ranking.npy` the token ranking
    (made from the first run's training responses, unless `ranking` is given, and kept on resume);
    `workdir/features` the cached target features (rows already computed under `reuse_features`,
    other runs' `features/` directories, are copied instead of recomputed); `workdir/best.json` the
    best validation result so far (the decoding-walk tau, `walk.py`; the teacher-forced accept length
    with `walk_rows=0`), kept across resumes. `on_best`,
    when given, is called with the parameters each time validation beats it (to export them: the
    last step is not always the best one).
    """

    target: Target
    drafter: LoadedDrafter
    cfg: TrainConfig
    workdir: Path
    log: Callable[[str], None] = print
    ranking: np.ndarray | None = None
    reuse_features: tuple[Path, ...] = ()
    on_best: Callable[[dict, dict[str, float]], None] | None = None

    def __post_init__(self):
        self.workdir = Path(self.workdir)
        d = self.drafter.config
        self.drafter.config.check_pair(self.target.config)
        if self.cfg.freeze_drafter and not d.cond_head_rank:
            raise ValueError("freezing the drafter trains only its conditioned head, and it has none (--cond-head R)")
        if self.cfg.marginal and (self.cfg.freeze_drafter or not d.cond_head_rank):
            raise ValueError("--marginal weighs the drafter's own law beside its conditioned head's: it needs a "
                             "head (--cond-head R) trained with the drafter (not --freeze-drafter)")
        gamma = default_gamma(d.block_size) if self.cfg.gamma is None else self.cfg.gamma  # (`or` took 0 as unset)
        self.obj = Objective(block_size=d.block_size, num_anchors=self.cfg.num_anchors, gamma=gamma,
                             mask_token_id=d.mask_token_id, distill=self.cfg.distill, miss_weight=self.cfg.miss_weight,
                             marginal=self.cfg.marginal)
        self.tx = optimizer(self.cfg)
        self.static = dict(drafter_def=self.drafter.graphdef, obj=self.obj, matmul_dtype=self.cfg.matmul_dtype)
        self.embed = self.target.state["embed_tokens"]["weight"][...]
        self.vocab: LossVocab | None = None
        self._progress = 0.0  # schedule progress of the last step run (saved with checkpoints)
        self.step = 0  # the step the weights have reached (after `fit`: where it stopped, early or not)
        self._started, self.seconds_before = time.perf_counter(), 0.0  # wall time: ours; earlier runs' (checkpointed)

    def prepare(self, train: TokenDataset) -> None:
        """The token ranking (kept in the work dir so a resumed run scores the same tokens) and the loss vocabulary."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.ranking is None:
            self.ranking = load_ranking(self.workdir)
        if self.ranking is None:
            self.ranking = rank_vocab(response_tokens(train), self.target.config.vocab_size)
        save_ranking(self.workdir, self.ranking)
        self.vocab = loss_vocab(self.target, self.ranking, self.cfg.draft_vocab)

    def feature_store(self, data: TokenDataset, name: str) -> FeatureStore:
        """Target features of `data`'s rows: cached under workdir/features, or computed on every use."""
        taps = tuple(self.drafter.config.target_layer_ids)
        if self.cfg.distill:  # the last layer's tap is the final normed hidden state (soft labels)
            taps += (self.target.config.num_hidden_layers - 1,)
        compute = partial(self._compute_features, taps=taps)
        keys = dict(taps=taps, target=target_fingerprint(self.target))
        directory = self.workdir / "features" if self.cfg.cache_features else None
        return FeatureStore(data.tokens, len(taps) * self.target.config.hidden_size, compute, directory, name, keys,
                            reuse=self.reuse_features)

    def _compute_features(self, tokens: np.ndarray, taps: tuple[int, ...]) -> jax.Array:
        return features_step(self.target.state, jnp.asarray(tokens), target_def=self.target.graphdef, tap_layers=taps,
                         cache_dtype=self.target.dtype)

    def _manager(self):
        import orbax.checkpoint as ocp

        options = ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=1, create=True)
        return ocp.CheckpointManager((self.workdir / "checkpoints").absolute(), options=options)

    def _restore(self, mngr, params, opt_state, ema):
        """The latest checkpoint's step, parameters, optimizer state and averaged weights (`ema`: None
        when the run averages none; a checkpoint saved without them starts the average at its weights)."""
        import orbax.checkpoint as ocp

        step = mngr.latest_step()
        if step is None:
            return 0, params, opt_state, ema
        state = {"params": params, "opt_state": opt_state}
        # A run that averages tries the checkpoint with its average first, then (switched on later) without.
        layouts = ([{**state, "ema": ema}] if ema is not None else []) + [state]
        for i, layout in enumerate(layouts):
            abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, layout)
            try:
                restored = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                      meta=ocp.args.JsonRestore()))
                break
            except (ValueError, KeyError, TypeError) as e:  # another drafter or optimizer layout
                if i + 1 == len(layouts):
                    raise ValueError(f"the checkpoint at step {step} in {self.workdir / 'checkpoints'} does not fit "
                                     "this run (another drafter shape, or the optimizer layout of runs made before "
                                     f"2026-11-26); start a new --out from its export with --init ({type(e).__name__})"
                                     ) from None
        meta = restored["meta"]
        # (when checkpoints are taken does not change the run: not worth a note)
        bookkeeping = ("save_every", "save_minutes", "log_every", "eval_every")
        saved = {k: v for k, v in (meta.get("train_config") or {}).items() if k not in bookkeeping}
        if saved != {k: v for k, v in dataclasses.asdict(self.cfg).items() if k not in bookkeeping}:
            self.log(f"note: resuming step {step} with a different training config than the one saved")
        self.log(f"resumed from {self.workdir / 'checkpoints'} at step {step}")
        self._progress = float(meta.get("progress", 0.0))  # how far a time-cut run had annealed
        self.seconds_before = float(meta.get("seconds_total", 0.0))  # (0 in checkpoints made before it was kept)
        params = restored["state"]["params"]
        if ema is not None:
            ema = restored["state"].get("ema")
            if ema is None:
                self.log(f"note: the checkpoint at step {step} has no averaged weights; the average starts there")
                ema = _copy(params)
        return step, params, restored["state"]["opt_state"], ema

    def _save(self, mngr, step: int, params, opt_state, ema) -> None:
        import orbax.checkpoint as ocp

        meta = {"train_config": dataclasses.asdict(self.cfg), "drafter_config": self.drafter.config.to_hf(),
                "progress": self._progress, "seconds_total": self.seconds_total()}
        state = {"params": params, "opt_state": opt_state} | ({} if ema is None else {"ema": ema})
        mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
                  force=True)

    def seconds_total(self) -> float:
        """Wall seconds spent on this work dir across resumes: earlier runs' up to their last checkpoint
        (what a killed run trained after it is lost, and so is its time) plus this process's so far."""
        return self.seconds_before + time.perf_counter() - self._started

    def run_facts(self) -> dict:
        """An export's `training.json` keys on the run, to read its figures against other runs': device, UTC
        date, step reached (below `steps` when cut by time), this process's wall seconds, `seconds_total`."""
        dev, seconds = jax.devices()[0], time.perf_counter() - self._started
        return {"device": {"kind": dev.device_kind, "platform": dev.platform, "count": jax.device_count()},
                "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(), "step": self.step,
                "seconds": round(seconds, 1), "seconds_total": round(self.seconds_before + seconds, 1)}

    def evaluate(self, params, data: TokenDataset, rows: int = VAL_ROWS, store: FeatureStore | None = None
                 ) -> dict[str, float]:
        """Teacher-forced figures over `rows` held-out rows (all of them when fewer), in batches of the
        training batch size, and the walk's tau. The row count does not follow the batch size, so runs
        trained with different batches report figures over the same rows (4 batches of 8 read 32 rows
        where 4 of 32 read 128; on the same held-out set drafter v12 read 2.90 over 128 rows and 4.55
        over the 4 rows a batch-1 run took)."""
        if self.vocab is None:
            self.prepare(data)
        store = store or self.feature_store(data, "val")
        it = batch_indices(len(data), self.cfg.batch_size, seed=self.cfg.seed + 1)
        key = jax.random.key(self.cfg.seed + 1)
        ms = []
        for i in range(max(1, math.ceil(min(rows, len(data)) / self.cfg.batch_size))):
            idx = next(it)
            ms.append(eval_step(params, self.vocab, self.embed, store.get(idx), jnp.asarray(data.tokens[idx]),
                                jnp.asarray(data.loss_mask[idx]), jax.random.fold_in(key, i), **self.static))
        ev = _mean(ms)
        if self.cfg.walk_rows:
            ev["walk_tau"] = self.walk_tau(params, data, store)
            if self.obj.marginal:  # a head trained with its drafter: the drafter without it too
                ev["walk_tau_own"] = self.walk_tau(params, data, store, condition=False)
        return ev

    def walk_tau(self, params, data: TokenDataset, store: FeatureStore, condition: bool = True) -> float:
        """Chain tau of greedy decoding walked over the first `walk_window` response positions of the
        first `walk_rows` rows of `data` (`walk.py`): what the engine's dflash mode would measure on
        those prompts when the rows are the target's greedy answers (`condition` false: drafting
        without the conditioned head)."""
        rows = min(self.cfg.walk_rows, len(data))
        chunk = min(rows, rows_per_call(self.cfg.walk_window, self.obj.block_size, int(self.vocab.head.shape[0])))
        tokens = steps = 0
        for lo in range(0, rows, chunk):
            idx = np.minimum(np.arange(lo, lo + chunk), rows - 1)  # the last call padded: one compiled shape
            run, valid = walk_runs(params, self.vocab, self.embed, store.get(idx), jnp.asarray(data.tokens[idx]),
                                   jnp.asarray(data.loss_mask[idx]), window=self.cfg.walk_window, condition=condition,
                                   **self.static)
            real = min(chunk, rows - lo)
            t, n = walk(np.asarray(run)[:real], np.asarray(valid)[:real])
            tokens, steps = tokens + t, steps + n
        return tokens / max(steps, 1)

    def best(self) -> dict[str, float] | None:
        """The best validation result so far (with its step), or None before the first evaluation."""
        path = self.workdir / "best.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def _note_validation(self, params, ev: dict[str, float]) -> None:
        best = self.best()
        # The walk's tau where both have it (runs begun before it compare teacher-forced figures).
        key = "walk_tau" if "walk_tau" in ev and (best is None or "walk_tau" in best) else "accept_len"
        if best is not None and ev[key] <= best[key]:
            return
        if self.on_best is not None:
            self.on_best(params, ev)
        (self.workdir / "best.json").write_text(json.dumps(ev, indent=2))
        self.log(f"step {ev['step']}: best validation so far")

    def _validate(self, params, val: TokenDataset, store, step: int, what: str = "") -> None:
        """Validate `params` as step `step`: a "val" row in metrics.jsonl, a log line, the best record."""
        ev = dict(self.evaluate(params, val, store=store), step=step)
        with open(self.workdir / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"split": "val", **ev}) + "\n")
        self.log(f"step {step}{f' ({what})' if what else ''}: val loss {ev['loss']:.3f} | first-token acc "
                 f"{ev['acc_first']:.3f} | teacher-forced tau {ev['accept_len']:.2f}"
                 + (f" | decoding-walk tau {ev['walk_tau']:.3f}" if "walk_tau" in ev else "")
                 + (f" (without the head {ev['walk_tau_own']:.3f})" if "walk_tau_own" in ev else ""))
        self._note_validation(params, ev)

    def mark_misses(self, params, data: TokenDataset, store: FeatureStore, progress: bool = True) -> np.ndarray:
        """[rows, S] bool: the first misses of every row's uniform anchors under `params` (one forward
        per batch, no gradient; computes the rows' features if not stored yet). Without it a row's
        first visit, all of a run shorter than an epoch, would draw uniform anchors."""
        from tqdm import tqdm

        t0, rows, b = time.perf_counter(), len(data), self.cfg.batch_size
        out = np.zeros(data.tokens.shape, bool)
        key = jax.random.key(self.cfg.seed + 2)
        for i in tqdm(range(math.ceil(rows / b)), disable=not progress, desc="marking misses", unit="batch"):
            idx = np.arange(i * b, (i + 1) * b) % rows  # the last batch wraps: one compiled shape
            out[idx] = np.asarray(misses_step(params, self.vocab, self.embed, store.get(idx),
                                              jnp.asarray(data.tokens[idx]), jnp.asarray(data.loss_mask[idx]),
                                              jax.random.fold_in(key, i), **self.static))
        store.flush()
        self.log(f"marked the first misses of {rows} rows with the starting weights "
                 f"({out.sum() / max(1, rows):.1f} per row) in {time.perf_counter() - t0:.0f} s")
        return out

    def fit(self, train: TokenDataset, val: TokenDataset | None = None, progress: bool = True,
            max_seconds: float | None = None, validate_start: bool = False,
            trace_dir: str | Path | None = None) -> LoadedDrafter:
        """Run to `cfg.steps` (resuming if checkpoints exist); returns the trained drafter (fp32).

        `max_seconds` (wall time of this call) ends the run early at a step boundary, validated,
        checkpointed and resumable, so a job inside a time-limited session or device lease keeps
        what it trained. The schedule's progress is the larger of steps done / `cfg.steps` and, with
        `max_seconds`, the time used: a resumed run starts from the progress its checkpoint reached
        and spreads the rest of the schedule over its own `max_seconds`.

        Throughput is logged as drafter positions per second: block positions carrying a loss per
        wall second of training steps (batch assembly, feature lookup or computation, the step),
        leaving out each process's first step (compilation), evaluation and checkpointing.

        `validate_start` (a run that continues a trained drafter): a fresh run validates the starting
        weights before its first step, as step 0, so they are the record to beat: `best.json` /
        `on_best` then name a trained step only where one validates better than where it began.

        `trace_dir`: this call's 6th to 8th steps run under `jax.profiler` (the first compiles, the next
        four settle), summarised per XLA op into `trace_dir`/step-trace.md (`trace_report`): where a
        step's device time goes, the target's feature forward against the drafter's own step."""
        from tqdm import tqdm

        self.prepare(train)
        params = jax.tree.map(lambda a: jnp.array(a, jnp.float32, copy=True), self.drafter.state)  # fp32 master copy (donated)
        opt_state = self.tx.init(params)
        ema = _copy(params) if self.cfg.ema else None  # what validation and the export read, when averaging
        decay = jnp.float32(self.cfg.ema)
        mngr = self._manager()
        step, params, opt_state, ema = self._restore(mngr, params, opt_state, ema)
        self.step = step
        store, val_store = self.feature_store(train, "train"), val and self.feature_store(val, "val")
        if store.data is not None:
            self.log(f"target features: {store.cached}/{len(train)} training rows stored "
                     f"({store.reused} copied from earlier runs on creation)")
        key = jax.random.key(self.cfg.seed)
        indices = batch_indices(len(train), self.cfg.batch_size, self.cfg.seed, start_step=step)
        if validate_start and val is not None and step == 0:
            self._validate(params, val, val_store, 0, "the starting weights")
        # Where each row's chains missed on its last visit (`first_misses`), marked first with the
        # weights this call starts from (a resumed run marks with its checkpoint's).
        misses = None if self.cfg.miss_weight == 1.0 else self.mark_misses(params, train, store, progress)
        history: list[Metrics] = []
        log_path = self.workdir / "metrics.jsonl"
        busy, positions, first = 0.0, 0, True
        total_busy, total_positions, start = 0.0, 0, step
        bar = tqdm(total=self.cfg.steps, initial=step, disable=not progress, desc="train", unit="step")
        deadline = None if max_seconds is None else time.perf_counter() + max_seconds
        floor = self._progress  # a resumed run goes on from where the last one's schedule stood
        saved_at = time.perf_counter()
        tracer = StepTracer(trace_dir, first=5, steps=3, log=self.log)
        while step < self.cfg.steps:
            tracer.before(step - start)
            t0 = time.perf_counter()
            idx = next(indices)
            done = max(step / self.cfg.steps, floor)
            if deadline is not None:
                used = 1.0 - (deadline - t0) / max_seconds  # of this call's time
                done = max(done, floor + (1.0 - floor) * used)
            self._progress = min(done, 1.0)
            opt_state = set_learning_rate(opt_state, learning_rate(self.cfg, self._progress))
            prefer = None if misses is None else jnp.asarray(misses[idx])
            params, opt_state, m, seen = train_step(params, opt_state, self.vocab, self.embed, store.get(idx),
                                                    jnp.asarray(train.tokens[idx]), jnp.asarray(train.loss_mask[idx]),
                                                    jax.random.fold_in(key, step), prefer, tx=self.tx,
                                                    head_only=self.cfg.freeze_drafter, **self.static)
            if misses is not None:
                misses[idx] = np.asarray(seen)  # what the next visit of these rows prefers
            if ema is not None:
                ema = ema_update(ema, params, decay)
            n_pos = int(m.positions)  # waits for the step
            if first:
                self.log(f"first step (compiling) took {time.perf_counter() - t0:.1f} s")
                first = False
            else:
                busy += time.perf_counter() - t0
                positions += n_pos
            step += 1
            self.step = step
            tracer.after(step - start)
            history.append(m)
            bar.update(1)
            stopping = deadline is not None and time.perf_counter() >= deadline and step < self.cfg.steps
            if stopping:
                self.log(f"step {step}: --max-seconds reached; stopping here (resumable)")
            last = step == self.cfg.steps or stopping
            if step % self.cfg.log_every == 0 or last:
                avg = _mean(history)
                history = []
                rate = positions / busy if busy else None
                total_busy, total_positions = total_busy + busy, total_positions + positions
                busy, positions = 0.0, 0
                avg.update(step=step, positions_per_s=rate, cached_sequences=store.cached)
                bar.set_postfix(loss=f"{avg['loss']:.3f}", acc=f"{avg['acc_first']:.2f}", tau=f"{avg['accept_len']:.2f}",
                                pos_s=f"{rate:.0f}" if rate else "-")
                with open(log_path, "a") as f:
                    f.write(json.dumps({"split": "train", **avg}) + "\n")
            evaluating = val is not None and (last or (self.cfg.eval_every and step % self.cfg.eval_every == 0))
            if evaluating:
                shipped, what = (params, "") if ema is None else (ema, "averaged weights")
                self._validate(shipped, val, val_store, step, what)
            overdue = self.cfg.save_minutes > 0 and time.perf_counter() - saved_at >= 60 * self.cfg.save_minutes
            if step % self.cfg.save_every == 0 or last or overdue:
                self._save(mngr, step, params, opt_state, ema)
                store.flush()
                saved_at = time.perf_counter()
            if stopping:
                break
        bar.close()
        tracer.close()
        if val_store:
            val_store.flush()
        if total_busy:
            self.log(f"trained steps {start + 1}..{step}: {total_positions / total_busy:.0f} drafter positions/s "
                     f"({total_busy / max(1, step - start - 1):.2f} s/step after the first)")
        mngr.wait_until_finished()
        mngr.close()
        return dataclasses.replace(self.drafter, state=params if ema is None else ema)
