// Elementwise kernels of the CUDA backend, compiled at run time with NVRTC.
//
// Self-contained: no headers (NVRTC from pip ships no cuda_fp16.h or
// cuda_bf16.h). bf16 and f16 values are stored as 16-bit integers and
// converted with PTX `cvt` instructions (bf16 `cvt` needs sm_80, the oldest
// target). All arithmetic is in f32; results round to nearest even.
//
// Launch: 1-D grid-stride loops; any grid and block size is correct.

typedef unsigned short u16;
typedef unsigned long long u64;

__device__ __forceinline__ float bf16_to_f32(u16 h) {
    return __uint_as_float(((unsigned int)h) << 16);
}

__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

struct F32 {
    typedef float T;
    static __device__ __forceinline__ float load(T v) { return v; }
    static __device__ __forceinline__ T store(float v) { return v; }
};
struct BF16 {
    typedef u16 T;
    static __device__ __forceinline__ float load(T v) { return bf16_to_f32(v); }
    static __device__ __forceinline__ T store(float v) { return f32_to_bf16(v); }
};
struct F16 {
    typedef u16 T;
    static __device__ __forceinline__ float load(T v) { return f16_to_f32(v); }
    static __device__ __forceinline__ T store(float v) { return f32_to_f16(v); }
};

#define GRID_STRIDE(i, n) \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (u64)gridDim.x * blockDim.x)

// dst[i] += src[i], both of type D, summed in f32.
template <typename D>
__device__ __forceinline__ void add(typename D::T* __restrict__ dst, const typename D::T* __restrict__ src, u64 n) {
    GRID_STRIDE(i, n) { dst[i] = D::store(D::load(dst[i]) + D::load(src[i])); }
}

extern "C" __global__ void add_f32(float* __restrict__ dst, const float* __restrict__ src, u64 n) { add<F32>(dst, src, n); }
extern "C" __global__ void add_bf16(u16* __restrict__ dst, const u16* __restrict__ src, u64 n) { add<BF16>(dst, src, n); }
extern "C" __global__ void add_f16(u16* __restrict__ dst, const u16* __restrict__ src, u64 n) { add<F16>(dst, src, n); }

// Up to MAX_TERMS f32 arrays, passed by value (a plan's sums have at most 3 terms).
#define MAX_TERMS 8
struct Terms {
    const float* p[MAX_TERMS];
};

// dst[i] = sum_t terms.p[t][i] for t < k, summed in f32, stored as D.
// `dst` may alias terms.p[0] (an in-place sum), so no __restrict__ on it.
template <typename D>
__device__ __forceinline__ void sum(typename D::T* dst, Terms terms, int k, u64 n) {
    GRID_STRIDE(i, n) {
        float acc = 0.0f;
        for (int t = 0; t < k && t < MAX_TERMS; ++t) acc += terms.p[t][i];
        dst[i] = D::store(acc);
    }
}

extern "C" __global__ void sum_f32(float* dst, Terms terms, int k, u64 n) { sum<F32>(dst, terms, k, n); }
extern "C" __global__ void sum_to_bf16(u16* dst, Terms terms, int k, u64 n) { sum<BF16>(dst, terms, k, n); }
extern "C" __global__ void sum_to_f16(u16* dst, Terms terms, int k, u64 n) { sum<F16>(dst, terms, k, n); }

// Casts between f32 and the 16-bit types.
template <typename From, typename To>
__device__ __forceinline__ void cast(typename To::T* __restrict__ dst, const typename From::T* __restrict__ src, u64 n) {
    GRID_STRIDE(i, n) { dst[i] = To::store(From::load(src[i])); }
}

extern "C" __global__ void cast_f32_to_bf16(u16* __restrict__ dst, const float* __restrict__ src, u64 n) {
    cast<F32, BF16>(dst, src, n);
}
extern "C" __global__ void cast_f32_to_f16(u16* __restrict__ dst, const float* __restrict__ src, u64 n) {
    cast<F32, F16>(dst, src, n);
}
extern "C" __global__ void cast_bf16_to_f32(float* __restrict__ dst, const u16* __restrict__ src, u64 n) {
    cast<BF16, F32>(dst, src, n);
}
extern "C" __global__ void cast_f16_to_f32(float* __restrict__ dst, const u16* __restrict__ src, u64 n) {
    cast<F16, F32>(dst, src, n);
}
