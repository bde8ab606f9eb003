#!/usr/bin/env bash
# The GPU validation of the CUDA backend in one command, on a bare GPU host:
# no Rust toolchain, no network; Python with jax[cuda12] or jax[cuda13] (its
# pip CUDA libraries and NCCL). Runs from a library built elsewhere:
#
#   here (any x86-64 Linux with Rust):
#     cargo build --release --features cuda             # target/release/libcommfuse.so
#     cargo test --release --features cuda --no-run     # prints the unit-test binary's path
#   there, from a copy of the repository (python/, jax_tests/, scripts/):
#     scripts/gpu_device_check.sh path/to/libcommfuse.so [path/to/unit-test-binary]
#
# Prints one table (libraries, kernels, every op kind on one GPU against the
# CPU reference, the per-call cost against XLA's dot, the GPU tests, two
# ranks on one GPU) and writes it as markdown to $OUT_TABLE
# (default gpu_check_table.md), the full logs of its subprocesses to
# $LOG_DIR (default gpu_check_logs/). CHECKS="rust one_rank ..." runs only
# those (names in scripts/gpu_device_check.py). Exits non-zero if any row failed.
set -uo pipefail
cd "$(dirname "$0")/.."
lib=${1:?usage: scripts/gpu_device_check.sh LIBCOMMFUSE_SO [RUST_TEST_BINARY]}
COMMFUSE_LIBRARY=$(realpath "$lib")
# The checks run several JAX processes on the GPU at once: none may take most of its memory.
export COMMFUSE_LIBRARY PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 scripts/gpu_device_check.py --out "${OUT_TABLE:-gpu_check_table.md}" --logs "${LOG_DIR:-gpu_check_logs}" \
    ${2:+--rust-tests "$(realpath "$2")"} ${CHECKS:+--only $CHECKS}
