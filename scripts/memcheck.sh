#!/usr/bin/env bash
# The Rust tests that cross the C ABI under valgrind's memcheck: the call
# frame layer and its handlers (src/xla), the transport, and a short frame
# fuzz (tests/frame_fuzz.rs). Fails on any invalid read or write, use of
# uninitialised memory, or definite leak. CI runs it (.ci/run); about two
# minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."

# The path of a test binary, built without running it.
test_binary() {
    cargo test --no-run --message-format=json "$@" 2>/dev/null |
        python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["executable"])' | tail -n 1
}

memcheck=(valgrind --quiet --error-exitcode=99 --leak-check=full --errors-for-leak-kinds=definite
          --show-leak-kinds=definite --track-origins=yes)

lib=$(test_binary --lib)
# (The transport's link-model tests time transfers: not under valgrind.)
"${memcheck[@]}" "$lib" --test-threads 2 xla:: abi:: call:: prepare:: problem:: backend::cpu::transport::tests \
    --skip throttled --skip switch_port --skip both_neighbours --skip when_its_step_became_ready --skip share_its_ports

fuzz=$(test_binary --test frame_fuzz)
COMMFUSE_FUZZ_ITERATIONS=1000 "${memcheck[@]}" "$fuzz" --test-threads 1

unreportable=$(test_binary --test unreportable)
"${memcheck[@]}" "$unreportable"
echo "memcheck: no errors"
