#!/usr/bin/env bash
# What to run when a session is lent a GPU (the device tool), one step per call, calls back to back:
# each step ends inside the 10-minute limit of one command and writes what it measured under $OUT.
#
#   bash benchmarks/gpu_session.sh check    # versions; the prefix kernel compiled for this GPU vs the XLA loop
#   bash benchmarks/gpu_session.sh verify   # verify_probe at Qwen3-8B shapes: AR vs HBM floor, verify(b)/AR,
#                                           # compiling no tree step (so it returns even if tree_prefill will not);
#                                           # then scanned layers with XLA's dynamic-slice fusion
#   bash benchmarks/gpu_session.sh perf     # perf_8b at Qwen3-8B shapes (random bf16 weights), Pallas kernel
#   bash benchmarks/gpu_session.sh perf-xla # the same with the XLA prefix loop, to compare
#   bash benchmarks/gpu_session.sh stash    # keep the carried GGUF piece (.device/pI) for the drafter job
#
#   bash benchmarks/gpu_session.sh probe    # compile times of the steps under XLA flag variants (compile_probe)
#   bash benchmarks/gpu_session.sh arbatch  # SmolLM2 AR decode at batch 128: the step alone vs the engine
#   bash benchmarks/gpu_session.sh floor    # XLA's products alone at 8B shapes vs the HBM floor, 3 flag variants
#   bash benchmarks/gpu_session.sh e2e      # the default pair end to end (ar, dflash, fixed, bastion), after
#                                           # gpu_drafter.sh converted the target on the same warm machine
#
# A 15-minute lease (five so far: an H200, three H100s, an H200; a start took ~35-60 s). The fourth
# (2026-11-27, `benchmarks/results/h100-2026-11-27-lease.md`) brought the first 8B-shaped ratios
# (verify_probe: verify(256)/AR 1.36, verify(64)/AR 1.11-1.17) and found the scanned AR step at 0.30
# of its HBM floor because XLA copies every layer's weights out of the stack; layers are unrolled by
# default since. tree_prefill at 8B shapes has still never been compiled on a GPU.
#
# Order (2026-12-04, after the fifth lease, `benchmarks/results/h200-2026-12-04-lease.md`): the unrolled
# verify probe is done (AR 0.57 of the HBM floor on an H200), and 553 s of drafter training gave v17
# (+9% tau on every evaluation set, 8,117 steps: a GPU's steps are what moves this drafter, the curve was
# still rising). Never run on a GPU yet: tree_prefill at 8B shapes (perf) and the default pair end to end
# (e2e). So, after running `training_data/smollm2-135m-instruct/device_pieces.sh` here (four pieces since the
# datastore's 2026-12-05 rebuild, 57 MiB each with the tracked files: commit nothing between the calls, results after the lease),
# back to back:
# The lease is 900 s with the start (~45 s) and the drafter's steps are what moves tau, so the measuring
# calls are cut to what answers their question:
#   1. carry .device/p1: `bash benchmarks/gpu_session.sh stash && BUCKETS=1,64 CONTEXTS=2048
#      timeout 190 bash benchmarks/gpu_session.sh perf` (timeout_s ~210): perf_8b's whole step at 8B
#      shapes, tree steps and the bastion loop included, on a reduced grid (the full grid took ~330-360 s),
#      then a profiler trace of 5 AR and 5 verify(64) steps summarised per XLA op (`benchmarks/step_trace.py`:
#      trace-pallas/step-trace.md; where the AR step's missing 43% and verify(64)'s extra 25% go);
#   2. carry .device/p2: `bash benchmarks/gpu_session.sh stash && timeout 110 bash benchmarks/gpu_session.sh
#      floor` (timeout_s ~125): where the AR step's missing 43% goes (XLA's products alone, separate vs
#      q|k|v and gate|up side by side, CUDA graphs as they are / on for every kind / off);
#   2b. carry .device/p3: `bash benchmarks/gpu_session.sh stash` (timeout_s ~30; as many such calls as
#      device_pieces.sh names before the last piece);
#   3. carry the last piece: `DATA_S=0 bash training_data/smollm2-135m-instruct/gpu_drafter.sh SECONDS`,
#      SECONDS = min(560, status's budget_left_s - 200), timeout_s = SECONDS + 25. It continues the shipped
#      pair (v17: drafter + recurrent rank-256 head) with `--marginal 1.0` (v17's run lacked it and its
#      head-free law fell 10%) on every committed set (the maths, docstring and passage sets m17, m18, p19
#      included since 2026-12-04: the fifth lease's run left them out; with m22, c20-c23, the code set k24 and m25 since then,
#      33,212 distinct rows, ~6.1M loss tokens at seq 384, against the fifth lease's 20,525), 6,000 steps of batch 32 at lr
#      3e-4 (~410 s on an H200; a shorter budget cuts the cosine on wall time). Its validation walks
#      32 held-out rows with the head and without it (`walk_tau`, `walk_tau_own` in ret/*-metrics.jsonl);
#      ret/v9a is best/ by the head's walk, ret/v9a-final the last step; ret/trace-v9a-*/step-trace.md where a
#      training step's GPU time goes (target feature forward against the drafter's step: `--trace`). The tar comes back in 15 MB pieces
#      ($OUT allows 16 MB a file: never tar a drafter whole into $OUT). It leaves the converted target
#      in runs/gpu-drafter/smollm2-f32 on the warm machine;
#   4. carry the last piece again, at once: `PROMPTS=2 timeout 150 bash benchmarks/gpu_session.sh e2e`
#      (timeout_s ~165): the default pair end to end (ar, dflash, fixed:16/64, bastion; 2 prompts of each
#      evaluation set, 128 new tokens, texts checked against AR). If the machine went back in between,
#      it converts the target again from the GGUF pieces (stash them first: calls 1-2b again);
#   5. with time left (the machine stays warm 30 s): continue the last step at lr 1e-4 for what remains, as
#      the 2026-12-04 lease's second run did (the command is in that results file), its best/ split in pieces.
# Then measure the exports here with `train_drafter eval` (head on and off) and end to end
# (`cpu-smollm2-drafter-v17-ab.md` says how) before shipping one whole (drafter and head together:
# cond_head.json records the drafter's fingerprint, and beside another drafter the head is refused).
#
# Nothing is installed: the machine's image has JAX (CUDA), Flax, Optax, Orbax, safetensors and
# tokenizers, and random-weight runs need nothing else (gguf is imported only to read a GGUF). The
# repo runs from its checkout (PYTHONPATH), so `pip install` and its version pins are skipped.
# Copy the results from $OUT into benchmarks/results/ and commit them with the device and date.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
step="${1:?usage: gpu_session.sh check|verify|perf|perf-xla|stash|probe|arbatch|floor|e2e}"

case "$step" in
  check)
    python3 -c "import jax, flax, optax, orbax.checkpoint as o; print('jax', jax.__version__, 'flax', flax.__version__, \
'optax', optax.__version__, 'orbax', o.__version__, jax.devices())" | tee "$OUT/gpu-versions.txt"
    # -n 0: one process owns the GPU; JAX_PLATFORMS=cuda, or the tests' conftest would pick the CPU.
    JAX_PLATFORMS=cuda python3 -m pytest -q -n 0 -p no:cacheprovider tests/test_prefix_kernel.py 2>&1 \
      | tee "$OUT/gpu-kernel-tests.log"
    ;;
  stash)
    mkdir -p /root/stash && cp .device/p*/gguf.xz.? /root/stash/ && ls -la /root/stash
    ;;
  verify)
    python3 -m benchmarks.verify_probe --buckets 1,16,64,256 --contexts 1024,2048 --name verify-probe-qwen3-8b \
      --out-dir "$OUT" --compilation-cache /tmp/jax-cache 2>&1 | tee "$OUT/verify.log"
    # scanned layers copied each layer's weights (2026-11-27); XLA's dynamic-slice fusion might read
    # them in place instead (an experimental flag: a failure here costs only this part)
    XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_gpu_enable_dynamic_slice_fusion=true" timeout 150 \
      python3 -m benchmarks.verify_probe --layers-layout scanned --buckets 1,64 --contexts 1024 \
      --name verify-probe-qwen3-8b-scanned-dsf --out-dir "$OUT" 2>&1 | tee "$OUT/verify-scanned-dsf.log" || true
    ;;
  perf | perf-xla)
    mode=pallas
    [ "$step" = perf-xla ] && mode=xla
    python3 -m benchmarks.perf_8b --prefix-attention "$mode" --layers-layout "${LAYOUT:-auto}" \
      --buckets "${BUCKETS:-1,16,32,64,128,256}" --contexts "${CONTEXTS:-1024,2048}" \
      --name "perf-qwen3-8b-$mode" --out-dir "$OUT" --compilation-cache /tmp/jax-cache \
      --trace "$OUT/trace-$mode" 2>&1 | tee "$OUT/perf-$mode.log"
    # (the trace: 5 AR and 5 verify(largest bucket) steps under jax.profiler, after the results are
    # written; $OUT/trace-$mode/step-trace.md names the ops that hold each step's time. An xplane.pb over
    # the 16 MB a returned file may have is dropped: the .trace.json.gz and the HLO texts are what it reads)
    find "$OUT/trace-$mode" -name '*.xplane.pb' -size +15M -delete 2>/dev/null || true
    ;;
  probe)
    # scanned layers compile one body whatever the depth: 4 of them probe the same body as 36, faster
    # (unrolled, the default since 2026-11-27, would not). The third lease ran every flag variant: none
    # rescued tree_prefill; the default alone now. Then SmolLM2's steps at batch 128.
    python3 -m benchmarks.compile_probe --layers 4 --scan yes --timeout 120 --name probe-qwen3-8b --variants default \
      --out-dir "$OUT" 2>&1 | tee "$OUT/probe.log"
    python3 -m benchmarks.compile_probe --arch smollm2-135m --dtype float32 --batch 128 --prompt 128 --cache-len 768 \
      --variants default --timeout 90 --name probe-smollm2-b128 --out-dir "$OUT" 2>&1 | tail -n 4 | tee -a "$OUT/probe.log"
    ;;
  arbatch)
    # the data job's shapes; its float32 products are exact (no TF32), as the data job sets
    JAX_DEFAULT_MATMUL_PRECISION=highest python3 -m benchmarks.ar_batch_probe --batch 128 --cache-len 768 \
      --name ar-batch128-smollm2 --out-dir "$OUT" 2>&1 | tee "$OUT/arbatch.log"
    ;;
  floor)
    # Why the AR step reads its weights at 0.57 of the HBM floor (H200, 2026-12-04): XLA's products alone,
    # 7 or 4 (q|k|v, gate|up side by side) per layer (`ar_floor_probe`), under command buffers (CUDA
    # graphs) as they are, on for every command kind, and off. ~25-40 s per variant at 8B shapes; the
    # model's own AR step under the variant that wins here is the next lease's `verify` with XLA_FLAGS.
    i=0
    for flags in "" \
        "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1" \
        "--xla_gpu_enable_command_buffer="; do
      XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }$flags" timeout 45 python3 -m benchmarks.ar_floor_probe --reps 10 \
        --name "ar-floor-qwen3-8b-flags$i" --out-dir "$OUT" 2>&1 | tee -a "$OUT/floor.log" || true
      i=$(( i + 1 ))
    done
    ;;
  e2e)
    # The default pair end to end on this GPU (issue 14: AR, dflash, bastion tokens/s; never measured on a
    # GPU before): the target gpu_drafter.sh converted in an earlier call of the same warm machine (runs/
    # survives between calls), the shipped drafter, the evaluation prompts carried in the last piece's
    # bench/ (device_pieces.sh). ar, dflash, a fixed sweep and bastion, T = 0, texts checked against AR.
    target="${TARGET:-runs/gpu-drafter/smollm2-f32}"
    bench=$(ls -d .device/p*/bench 2>/dev/null | tail -n 1)
    if [ ! -f "$target/config.json" ] && [ -z "${TARGET:-}" ]; then  # not left by a training call: convert it
      CONVERT_ONLY=1 bash training_data/smollm2-135m-instruct/gpu_drafter.sh 120 >&2 || true
    fi
    [ -f "$target/config.json" ] || { echo "error: no converted target at $target (the GGUF pieces: stash them)" >&2; exit 1; }
    [ -n "$bench" ] || { echo "error: no .device/p*/bench carried (device_pieces.sh lays it out)" >&2; exit 1; }
    python3 -m benchmarks.run --target "$target" --drafter bastion_jax/assets/smollm2-135m-instruct-dflash \
      --prompts "$bench"/*.jsonl.gz --max-prompts "${PROMPTS:-4}" --max-new-tokens "${MAXNEW:-128}" --reps 2 \
      --modes ar,dflash,fixed:16,fixed:64,bastion --buckets 1,4,8,16,32,64 --name "${NAME:-gpu-smollm2-e2e}" \
      --out-dir "$OUT" 2>&1 | tee "$OUT/e2e.log"
    ;;
  *)
    echo "unknown step $step (check, verify, perf, perf-xla, stash, probe, arbatch, floor, e2e)" >&2
    exit 2
    ;;
esac
