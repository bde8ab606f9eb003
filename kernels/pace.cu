// The one-rank mode's device clock (`src/backend/cuda/solo_device.rs`):
// a call is timed from one stamp to another on XLA's stream, read from the
// GPU's global timer. (Its pacing holds the stream from the host instead,
// `driver::launch_host`: a kernel would wait behind the GEMMs for an SM.)
//
// Self-contained: no headers (NVRTC from pip ships none).

typedef unsigned long long u64;

// Writes the global timer's nanoseconds to `at`. One thread.
extern "C" __global__ void commfuse_stamp(u64* at) {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    *at = t;
}
