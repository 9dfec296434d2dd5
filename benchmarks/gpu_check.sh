#!/usr/bin/env bash
# Every GPU check in one run, logs and figures in one folder (issue 28):
#   1. the GPU-saved fixtures (fixtures/make_gpu_fixtures.py);
#   2. side by side: `python -m pytest -m cuda`, and `ckptkit train --device cuda` killed with
#      SIGKILL and resumed, against an uninterrupted run (benchmarks/gpu_resume.py);
#   3. save, background-save and load timings of 1 and 4 GiB on the GPU, with the A/B of
#      save_on_master's overlapped host copies (benchmarks/bench_gpu.py; about 5 minutes on an H100).
# Each step has its own time limit, so one that hangs leaves the others' results.
#
#   bash benchmarks/gpu_check.sh [OUTDIR]       # default: $OUT, else out/gpu_check
#
# Without a GPU each step says so and the script exits 0. Wheels in .whl/ (isal for the CRC, on
# a machine that reaches no package index) are installed first. Exit status: 1 if a step failed.
# LIMIT_TESTS, LIMIT_BENCH (seconds) and TRAIN_SECONDS (each trainer run) size it.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-out/gpu_check}}
mkdir -p "$out"
logs=$(mktemp -d)
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
limit_tests=${LIMIT_TESTS:-300} limit_bench=${LIMIT_BENCH:-420} seconds=${TRAIN_SECONDS:-45}

if compgen -G ".whl/*.whl" >/dev/null; then
    $py -m pip install -q --no-index --no-deps --no-compile .whl/*.whl
fi
# ckptkit itself, for the `ckptkit` command; where it cannot be installed, the source tree on
# sys.path through a .pth file (the tests' trainer launches set PYTHONPATH themselves).
if ! $py -c "import ckptkit" 2>/dev/null; then
    $py -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$logs/install.log" 2>&1 \
        || echo "$PWD/src" >"$($py -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/ckptkit-src.pth"
fi
{
    date -u
    nvidia-smi 2>&1 | head -15
    $py -c "import torch, ckptkit, sys; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'ckptkit', ckptkit.__file__)"
    $py -c "import isal; print('isal', isal.__version__)" 2>&1 | tail -1
    command -v ckptkit || echo "no ckptkit command: python -m ckptkit.cli"
    df -hT "${TMPDIR:-/tmp}" .
} >"$logs/env.txt" 2>&1
cat "$logs/env.txt"
status=0
step() {  # step NAME LIMIT_S CMD...: run CMD under a time limit, its output to logs/NAME.log
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout -k 10 "$limit" "$@" >"$logs/$name.log" 2>&1
    local rc=$?
    echo "== $name: exit $rc in $((SECONDS - t0)) s" | tee -a "$logs/steps.txt"
    [ $rc -eq 0 ] || status=1
    return 0
}

step fixtures 120 $py fixtures/make_gpu_fixtures.py --out "$logs/fixtures"
par=$($py -c "import xdist" 2>/dev/null && echo "-n 4")  # the trainer tests side by side, where pytest-xdist is
step pytest_cuda "$limit_tests" $py -m pytest -m cuda -v -p no:cacheprovider --continue-on-collection-errors $par &
resume=${TMPDIR:-/tmp}/ckptkit-gpu-resume
step trainer_resume "$limit_tests" $py benchmarks/gpu_resume.py --out "$resume" --seconds "$seconds" &
wait
# the runs' own logs and metrics, to see why one failed
(cd "$resume" 2>/dev/null && find . -name '*.log' -o -name metrics.jsonl | tar -czf "$logs/trainer_runs.tar.gz" -T -)
step bench_gpu "$limit_bench" $py benchmarks/bench_gpu.py --gib ${BENCH_GIB:-1 4} --runs 3 --json "$logs/bench_gpu.json"

for name in pytest_cuda trainer_resume bench_gpu; do
    echo "---- $name (end)"
    tail -n 25 "$logs/$name.log"
done
cat "$logs/steps.txt"
tar -czf "$out/gpu_check.tar.gz" -C "$logs" .
cp "$logs/steps.txt" "$logs/pytest_cuda.log" "$logs/trainer_resume.log" "$logs/bench_gpu.log" "$out/" 2>/dev/null
exit $status
