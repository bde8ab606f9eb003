// Pacing kernels of the one-rank mode (`src/backend/cuda/solo.rs`): they
// hold a stream until a moment on the GPU's global timer, so that copies
// enqueued between them arrive at a link's rate. One thread each; they
// sleep between reads of the timer, leaving the SMs to the GEMMs.
//
// Self-contained: no headers (NVRTC from pip ships none).

typedef unsigned long long u64;

__device__ __forceinline__ u64 global_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Writes the global timer's nanoseconds to `at`.
extern "C" __global__ void commfuse_stamp(u64* at) {
    *at = global_ns();
}

// Returns once the global timer reads `*start + after_ns`; writes the time
// it returned at to `log` when `log` is not null.
extern "C" __global__ void commfuse_pace(const u64* start, u64 after_ns, u64* log) {
    u64 due = *start + after_ns;
    u64 now = global_ns();
    while (now < due) {
        __nanosleep(1000);
        now = global_ns();
    }
    if (log) {
        *log = now;
    }
}
