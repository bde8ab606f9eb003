#!/usr/bin/env bash
# On a GPU host with a CUDA jaxlib (pip install "jax[cuda12]"): build commfuse
# with the CUDA backend, run the Rust checks, the GPU tests, and the benchmark
# against XLA's unfused collectives and XLA's windowed einsum.
set -euo pipefail
cd "$(dirname "$0")/.."

nvidia-smi -L
python3 -c "import jax; print('JAX GPUs:', jax.devices('gpu'))"
python3 -m pip install --quiet nvidia-cuda-nvrtc-cu12 nvidia-cuda-nvcc-cu12

echo "== Rust: clippy and tests with the CUDA feature"
cargo clippy --all-targets --features cuda -- -D warnings
cargo test --features cuda -- --nocapture 2>&1 | grep -E "nvrtc:|^  |test result"

echo "== build and install with the CUDA backend"
COMMFUSE_FEATURES=cuda python3 -m pip install --quiet ".[test]"
python3 -c "import commfuse._native as n; print('cuda built:', n.cuda_built() if hasattr(n, 'cuda_built') else 'unknown')"

echo "== GPU tests"
python3 -m pytest jax_tests/test_gpu.py -m gpu -v

echo "== benchmark: fused vs XLA unfused"
python3 scripts/gpu_bench.py xla
echo "== benchmark: XLA windowed einsum (collective matmul decomposition)"
XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_threshold_for_windowed_einsum_mib=0 --xla_gpu_multi_streamed_windowed_einsum=true" \
    python3 scripts/gpu_bench.py xla_windowed
