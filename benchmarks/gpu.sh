#!/usr/bin/env bash
# The GPU checks, as one script for a machine with CUDA (a session that is lent one runs it there):
#   1. the engine against TorchDEQ at solver level (`benchmarks.solvers --device cuda`),
#   2. model level against TorchDEQ with the same f_θ (`benchmarks.torchdeq_models --device cuda`), at the
#      CPU benchmark's batch and at a batch that fills the GPU better,
#   3. per-sample halting with compaction against the uncompacted solve (`benchmarks.halting --device cuda`),
#   4. DEQ-DDIM against diffusers' DDIMPipeline and ParaDiGMS (`benchmarks.deq_ddim --device cuda`).
# Each step has its own time limit, so one slow step cannot take the others' time; a step that fails or runs
# out says so and the script goes on. Results (JSON, PNG, the log) go to OUT.
#     OUT=bench_results/gpu PYTHON=python3 bash benchmarks/gpu.sh     # GPU_COLD=1: without compiling first
set -uo pipefail
OUT=${OUT:-bench_results/gpu}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
mkdir -p "$OUT"

step() {  # LIMIT_SECONDS NAME COMMAND...
    local limit=$1 name=$2 t0 rc
    shift 2
    t0=$(date +%s)
    echo "== $name (limit ${limit}s)"
    timeout "$limit" "$@"
    rc=$?
    echo "== $name: rc $rc in $(($(date +%s) - t0)) s"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import sys, torch, transformers, huggingface_hub, diffusers, torchdeq
print('python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__,
      'huggingface_hub', huggingface_hub.__version__, 'diffusers', diffusers.__version__,
      'torchdeq', torchdeq.__version__ if hasattr(torchdeq, '__version__') else '0.1.0',
      'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
step 90 solvers $PY -m benchmarks.solvers --device cuda --out "$OUT/solvers_cuda.json"
step 100 models-b32 $PY -m benchmarks.torchdeq_models --device cuda --rounds 5 \
    --out "$OUT/torchdeq_models_cuda_b32.json"
step 100 models-b256 $PY -m benchmarks.torchdeq_models --device cuda --rounds 5 --batch 256 \
    --cases mdeq-infer,mdeq-train,mdeq-train-ce --out "$OUT/torchdeq_models_cuda_b256.json"
step 150 halting $PY -m benchmarks.halting --device cuda --rounds 5 --out "$OUT/halting_cuda.json"
step 120 deq-ddim $PY -m benchmarks.deq_ddim --device cuda --batch 8 --Ts 10 25 50 --budget 10 --lrs 0.05 \
    --out "$OUT/deq_ddim_cuda.json"
