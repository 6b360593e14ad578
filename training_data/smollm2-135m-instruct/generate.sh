#!/usr/bin/env bash
# Drafter v2 training data for SmolLM2-135M-Instruct (issue 13): the target's own greedy and T=0.7
# responses to training-split prompts, stdlib prompts and Magpie self-written prompts.
# Resumable: restores the committed progress into runs/data/ first, then `data` continues it.
# When done (or before a session ends): pack again and commit the .npz files here.
set -euo pipefail
cd "$(dirname "$0")/../.."
here=training_data/smollm2-135m-instruct
D=../shared/data
mkdir -p runs/data
for kind in greedy t07 t07s3 t07s4 c7 c8 c9 c10 c11 c12 c13 c14 c15 c16 m17 m18 p19 c20 c21 m22 c23 k24 m25 c26 x27; do
  if [ -f $here/$kind.npz ] && [ ! -f runs/data/$kind.jsonl ]; then
    python -m bastion_jax.train_drafter pack --data $here/$kind.npz --out runs/data/$kind.jsonl
  fi
  prompts=$here/magpie_prompts.jsonl.gz
  [ $kind = t07s3 ] && prompts=$here/magpie_prompts_s3.jsonl.gz  # its own self-written prompts (seed 3; 300 used)
  [ $kind = t07s4 ] && prompts=$here/magpie_prompts_s4.jsonl.gz  # likewise (seed 4)
  case $kind in c[0-9]*|m[0-9]*|p[0-9]*|k[0-9]*) prompts=$here/magpie_prompts_$kind.jsonl.gz ;; esac  # the chat / maths / code sets' own
  if [ -f $prompts ] && [ ! -f runs/data/$kind.jsonl.magpie.jsonl ]; then
    gunzip -c $prompts > runs/data/$kind.jsonl.magpie.jsonl
  fi
done
common="--sources $D/gsm8k_train.jsonl.gz $D/code_alpaca_2k.jsonl.gz --max-new-tokens 256 --batch-size 48 --stdlib 400 --magpie 1000"
python -m bastion_jax.train_drafter data --out runs/data/greedy.jsonl --num 3200 --seed 1 $common
python -m bastion_jax.train_drafter pack --data runs/data/greedy.jsonl --out $here/greedy.npz --vocab-size 49152
python -m bastion_jax.train_drafter data --out runs/data/t07.jsonl --num 3200 --seed 2 --temperature 0.7 $common
python -m bastion_jax.train_drafter pack --data runs/data/t07.jsonl --out $here/t07.npz --vocab-size 49152
# A third set: new prompts (seed 3 picks other gsm8k_train / code_alpaca / stdlib prompts) with the 300
# Magpie prompts written for it on a GPU (magpie_prompts_s3.jsonl.gz, 2026-11-26), sampled at T = 0.7.
python -m bastion_jax.train_drafter data --out runs/data/t07s3.jsonl --num 3200 --seed 3 --temperature 0.7 \
  ${common/--magpie 1000/--magpie 300}
python -m bastion_jax.train_drafter pack --data runs/data/t07s3.jsonl --out $here/t07s3.npz --vocab-size 49152
# A fourth set, made the same way with seed 4 and its own Magpie prompts (magpie_prompts_s4.jsonl.gz).
python -m bastion_jax.train_drafter data --out runs/data/t07s4.jsonl --num 3200 --seed 4 --temperature 0.7 \
  ${common/--magpie 1000/--magpie 300}
python -m bastion_jax.train_drafter pack --data runs/data/t07s4.jsonl --out $here/t07s4.npz --vocab-size 49152
# Chat-heavy sets (chat is where acceptance is lowest): only Magpie prompts, written on CPU for them
# (seed 7: 1500, seed 8: 800; magpie_prompts_c7 / _c8), responses sampled at T = 0.7.
chat="--sources --stdlib 0 --max-new-tokens 256 --batch-size 48 --temperature 0.7"
python -m bastion_jax.train_drafter data --out runs/data/c7.jsonl --num 1500 --seed 7 --magpie 1500 $chat
python -m bastion_jax.train_drafter pack --data runs/data/c7.jsonl --out $here/c7.npz --vocab-size 49152
python -m bastion_jax.train_drafter data --out runs/data/c8.jsonl --num 800 --seed 8 --magpie 800 $chat
python -m bastion_jax.train_drafter pack --data runs/data/c8.jsonl --out $here/c8.npz --vocab-size 49152
# A greedy chat set (decoding at T = 0 is what the drafter is measured on, and chat is its weakest
# kind): 800 new Magpie prompts (seed 9, magpie_prompts_c9), responses at temperature 0.
python -m bastion_jax.train_drafter data --out runs/data/c9.jsonl --num 800 --seed 9 --magpie 800 ${chat/--temperature 0.7/--temperature 0}
python -m bastion_jax.train_drafter pack --data runs/data/c9.jsonl --out $here/c9.npz --vocab-size 49152
# Greedy chat on prompts that start with a generic opener (--magpie-openers: write / explain / role-play /
# solve / code / extract ...): the bare user prefix gave mostly one kind of request (advice), a chat
# benchmark asks for many. 1200 prompts (seed 10, magpie_prompts_c10), responses at temperature 0.
python -m bastion_jax.train_drafter data --out runs/data/c10.jsonl --num 1200 --seed 10 --magpie 1200 --magpie-openers \
  ${chat/--temperature 0.7/--temperature 0}
python -m bastion_jax.train_drafter pack --data runs/data/c10.jsonl --out $here/c10.npz --vocab-size 49152
# More of the same, 1500 prompts each with their own Magpie prompts (magpie_prompts_cN): seed 11
# (2026-11-27, for the next GPU trainer), seed 12 (2026-11-28), seeds 13 and 14 (2026-12-02), each made
# on CPU in the background of a session. Seeds 11-14 sampled batch i with seed + i, so they mostly
# repeat c10 (README.md); seeds 15 and 16 (2026-12-02) draw one stream per (seed, batch) and are new.
greedy_chat() {  # seed: 1500 opener-seeded Magpie prompts of the target's own, greedy responses -> c$1.npz
  python -m bastion_jax.train_drafter data --out runs/data/c$1.jsonl --num 1500 --seed $1 --magpie 1500 --magpie-openers \
    ${chat/--temperature 0.7/--temperature 0}
  python -m bastion_jax.train_drafter pack --data runs/data/c$1.jsonl --out $here/c$1.npz --vocab-size 49152
}
for seed in 11 12 13 14 15 16; do greedy_chat $seed; done
# Kinds the sets above lack (2026-12-04): 800 LaTeX competition-style problems the target writes from
# maths openers (--magpie-openers math, magpie_prompts_m17) and 700 function-completion prompts (a
# signature and docstring from the standard library's sources, body left out; --docstrings, which reads
# this interpreter's stdlib: Python 3.11.7 made m17), responses at T = 0 (40 min on CPU, ~130 tokens/s).
python -m bastion_jax.train_drafter data --out runs/data/m17.jsonl --num 1500 --seed 17 --sources --stdlib 0 \
  --docstrings 700 --magpie 800 --magpie-openers math --temperature 0
python -m bastion_jax.train_drafter pack --data runs/data/m17.jsonl --out $here/m17.npz --vocab-size 49152
# More of those kinds (2026-12-04, later): 600 maths problems of the target's own from the maths openers
# (seed 18, magpie_prompts_m18) and 600 method-completion prompts (--methods: a class statement, then one
# public method's decorators, signature and docstring from the same stdlib sources, body left out), T = 0.
python -m bastion_jax.train_drafter data --out runs/data/m18.jsonl --num 1200 --seed 18 --sources --stdlib 0 \
  --methods 600 --magpie 600 --magpie-openers math --temperature 0
python -m bastion_jax.train_drafter pack --data runs/data/m18.jsonl --out $here/m18.npz --vocab-size 49152
# Tasks over a passage of prose (2026-12-04): 700 passages cut at paragraph breaks from the stdlib's
# language reference topics and module docstrings, each with a task (summarise, main points, explain,
# rewrite, question and answer, terms), and 500 maths problems of the target's own (seed 19,
# magpie_prompts_p19), T = 0; prompts kept to their last 320 tokens.
python -m bastion_jax.train_drafter data --out runs/data/p19.jsonl --num 1200 --seed 19 --sources --stdlib 0 \
  --passages 700 --magpie 500 --magpie-openers math --max-prompt-tokens 320 --temperature 0
python -m bastion_jax.train_drafter pack --data runs/data/p19.jsonl --out $here/p19.npz --vocab-size 49152
# Two more greedy opener-seeded chat sets (2026-12-04, the background of a CPU-only session; chat is still
# the kind the drafter accepts least): seeds 20 and 21 as c15 / c16, 1500 prompts each.
for seed in 20 21; do greedy_chat $seed; done
# More maths and methods (2026-12-04, the background of a CPU-only session: MATH-500 and HumanEval are
# the evaluation kinds the drafter accepts least after chat): 900 maths problems of the target's own
# (seed 22, magpie_prompts_m22) and 600 method-completion prompts, as m18; T = 0.
python -m bastion_jax.train_drafter data --out runs/data/m22.jsonl --num 1500 --seed 22 --sources --stdlib 0 \
  --methods 600 --magpie 900 --magpie-openers math --temperature 0
python -m bastion_jax.train_drafter pack --data runs/data/m22.jsonl --out $here/m22.npz --vocab-size 49152
# One more greedy opener-seeded chat set (2026-12-05, right after m22), as c20 / c21.
greedy_chat 23
# Code (2026-12-05): 1500 programming tasks the target wrote from the code openers (`--magpie-openers
# code`: 'Write a Python function that', 'Given a list of integers,', ...; seed 24), greedy responses.
python -m bastion_jax.train_drafter data --out runs/data/k24.jsonl --num 1500 --seed 24 --sources --stdlib 0 \
  --magpie 1500 --magpie-openers code --max-new-tokens 256 --batch-size 48 --temperature 0
python -m bastion_jax.train_drafter pack --data runs/data/k24.jsonl --out $here/k24.npz --vocab-size 49152
# More maths and function completions (2026-12-05, the end of a CPU-only session): 900 maths problems of
# the target's own (seed 25, magpie_prompts_m25.jsonl.gz, committed) and 600 function-completion prompts
# (--docstrings), as m17; T = 0. The prompts were committed first (the set would then have pushed the
# GGUF's device pieces from three to four); the answers followed once the datastore's rebuild had made
# them four anyway (2026-12-05).
python -m bastion_jax.train_drafter data --out runs/data/m25.jsonl --num 1500 --seed 25 --sources --stdlib 0 \
  --docstrings 600 --magpie 900 --magpie-openers math --max-new-tokens 256 --batch-size 48 --temperature 0
python -m bastion_jax.train_drafter pack --data runs/data/m25.jsonl --out $here/m25.npz --vocab-size 49152
# One more greedy opener-seeded chat set (2026-12-06, the end of a CPU-only session), as c23.
greedy_chat 26
# Answers that copy a given text (2026-12-07, a CPU-only session): the drafter's chain accepted 1.27
# tokens a step on news summaries, where a third to a half of the target's tokens continue an earlier
# occurrence of their last few tokens. 800 tasks (summarise, rewrite, extract, answer; `--text-tasks`)
# over the target's own answers in c26 and c23, and the standard library's passage tasks over longer
# passages (`--passage-chars 2500`: 364 such chunks, seed 27), prompts kept whole up to 704 tokens;
# greedy, 192 new tokens.
python -m bastion_jax.train_drafter data --out runs/data/x27.jsonl --num 1200 --seed 27 --sources --stdlib 0 \
  --passages 400 --passage-chars 2500 --text-tasks 800 --text-from $here/c26.npz $here/c23.npz \
  --max-prompt-tokens 704 --max-new-tokens 192 --batch-size 32 --temperature 0
python -m bastion_jax.train_drafter pack --data runs/data/x27.jsonl --out $here/x27.npz --vocab-size 49152
