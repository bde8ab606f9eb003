#!/usr/bin/env bash
# On a GPU host with a CUDA jaxlib (pip install "jax[cuda12]"): build commfuse
# with the CUDA backend, run every Rust and Python check (the device tests
# included), the GPU tests (1 GPU, all local GPUs, two processes, fp8 on
# sm_90), and the benchmark against XLA's unfused collectives and XLA's
# windowed einsum. Stops at the first failing step; its log is in $LOG_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
LOG_DIR="${LOG_DIR:-/tmp/commfuse_gpu_check}"
mkdir -p "$LOG_DIR"

step() {  # step NAME COMMAND...: runs COMMAND, keeps its output in $LOG_DIR/NAME.log
    local name=$1; shift
    echo "== $name"
    if ! "$@" 2>&1 | tee "$LOG_DIR/$name.log"; then
        echo "FAILED: $name (log: $LOG_DIR/$name.log)"; exit 1
    fi
}

nvidia-smi -L
nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv
python3 -c "import jax; print('JAX', jax.__version__, 'GPUs:', jax.devices('gpu'))"
python3 -m pip install --quiet nvidia-cuda-nvrtc-cu12 nvidia-cuda-nvcc-cu12

step fmt cargo fmt --check
step clippy cargo clippy --workspace --all-targets -- -D warnings
step clippy_cuda cargo clippy --workspace --all-targets --features cuda -- -D warnings
step test cargo test
# The device tests (backend/cuda/device.rs) run here: one GPU and all local GPUs.
step test_cuda cargo test --features cuda -- --nocapture

step install env COMMFUSE_FEATURES=cuda python3 -m pip install --quiet ".[test]"
rm -f python/commfuse/*.so
python3 -c "import commfuse._native as n; assert n.cuda_built(), 'library built without the cuda feature'; print('cuda built')"
python3 -c "import commfuse._native as n; print('NCCL unique id:', len(n.nccl_unique_id()), 'bytes')"

step gpu_tests python3 -m pytest jax_tests/test_gpu.py -v -rxXs
step cpu_suite python3 -m pytest jax_tests -q -m "not gpu"

step bench_xla python3 scripts/gpu_bench.py xla
step bench_windowed env XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_threshold_for_windowed_einsum_mib=0 --xla_gpu_multi_streamed_windowed_einsum=true" \
    python3 scripts/gpu_bench.py xla_windowed
echo "== all GPU checks passed; logs in $LOG_DIR"
