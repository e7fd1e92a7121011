// Shared helpers of every kernel file; the files are concatenated after this one into a single
// NVRTC program, so they need no #include (NVRTC then needs no include path either).

// The program's 16-bit element (weights, GEMM inputs, KV pool) as its bit pattern: bf16, or
// IEEE half when the program is compiled with TANDEM_F16 (the f16 compute mode). The engine
// stores both as u16 on the host too, and the bit patterns avoid cuda_bf16.h / cuda_fp16.h.
// Entry points keep their `_bf16` suffix in both programs: it names the 16-bit variant.
typedef unsigned short e16_t;

// bf16 whatever the program's element: round to nearest even, NaN stays NaN (what
// half::bf16::from_f32 does on the CPU), and back.
__device__ __forceinline__ unsigned short f32_to_bf16_bits(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (unsigned short)((u >> 16) | 0x40u);
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}
__device__ __forceinline__ float bf16_bits_to_f32(unsigned short b) { return __uint_as_float(((unsigned int)b) << 16); }

#ifdef TANDEM_F16
#define E16_MMA_TYPE "f16"
__device__ __forceinline__ float e16_to_f32(e16_t b) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(b));
    return f;
}
// Round to nearest even; beyond ±65504 the result is ±inf (the f16 mode's range limit).
__device__ __forceinline__ e16_t f32_to_e16(float f) {
    e16_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
// The low and high element of a packed pair.
__device__ __forceinline__ float e16_lo(unsigned int v) { return e16_to_f32((e16_t)(v & 0xffffu)); }
__device__ __forceinline__ float e16_hi(unsigned int v) { return e16_to_f32((e16_t)(v >> 16)); }
#else
#define E16_MMA_TYPE "bf16"
__device__ __forceinline__ float e16_to_f32(e16_t b) { return bf16_bits_to_f32(b); }
__device__ __forceinline__ e16_t f32_to_e16(float f) { return f32_to_bf16_bits(f); }
__device__ __forceinline__ float e16_lo(unsigned int v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float e16_hi(unsigned int v) { return __uint_as_float(v & 0xffff0000u); }
#endif

// An IEEE half element of a KV pool whatever the program's 16-bit element is: the f16 KV
// cache beside bf16 weights (the bf16x2 mode's `kv_cache_config.dtype: float16`). A type of
// its own, so that load_f / store_f pick the conversion by the pool's type.
struct h16_t {
    unsigned short bits;
};
__device__ __forceinline__ float h16_to_f32(unsigned short b) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(b));
    return f;
}

__device__ __forceinline__ float load_f(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ float load_f(const h16_t* p, long long i) { return h16_to_f32(p[i].bits); }
// Round to nearest even; beyond ±65504 the result is ±inf (f16's range).
__device__ __forceinline__ void store_f(h16_t* p, long long i, float v) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    p[i].bits = h;
}
__device__ __forceinline__ float load_f(const e16_t* p, long long i) { return e16_to_f32(p[i]); }
__device__ __forceinline__ void store_f(float* p, long long i, float v) { p[i] = v; }
__device__ __forceinline__ void store_f(e16_t* p, long long i, float v) { p[i] = f32_to_e16(v); }

// A GEMM input: f32 as is; bf16 rounded, and with lo_off != 0 also the rounding's remainder
// (v - hi, itself in bf16) lo_off elements further on. A GEMM over the stacked [hi; lo] rows,
// whose two output halves are then added (fold_rows_f32), sees v to about 2^-16 instead of
// bf16's 2^-8: the split-bf16 ("bf16x2") mode.
__device__ __forceinline__ void store_in(float* p, long long i, float v, long long lo_off) { p[i] = v; }
__device__ __forceinline__ void store_in(e16_t* p, long long i, float v, long long lo_off) {
    const e16_t hi = f32_to_e16(v);
    p[i] = hi;
    if (lo_off != 0) p[i + lo_off] = f32_to_e16(v - e16_to_f32(hi));
}

// Two consecutive GEMM inputs (i and lo_off even): one 8-byte store for f32, one 4-byte store
// of the two 16-bit values and, with lo_off != 0, one of their remainders.
__device__ __forceinline__ void store_in2(float* p, long long i, float v0, float v1, long long lo_off) {
    *reinterpret_cast<float2*>(p + i) = make_float2(v0, v1);
}
__device__ __forceinline__ void store_in2(e16_t* p, long long i, float v0, float v1, long long lo_off) {
    const e16_t h0 = f32_to_e16(v0), h1 = f32_to_e16(v1);
    *reinterpret_cast<unsigned int*>(p + i) = (unsigned int)h0 | ((unsigned int)h1 << 16);
    if (lo_off != 0) {
        *reinterpret_cast<unsigned int*>(p + i + lo_off) =
            (unsigned int)f32_to_e16(v0 - e16_to_f32(h0)) | ((unsigned int)f32_to_e16(v1 - e16_to_f32(h1)) << 16);
    }
}

// Four consecutive GEMM inputs (i a multiple of 4, lo_off too): one 16-byte store for f32, one
// 8-byte store of the four 16-bit values and, with lo_off != 0, one of their remainders.
__device__ __forceinline__ void store_in4(float* p, long long i, float4 v, long long lo_off) {
    *reinterpret_cast<float4*>(p + i) = v;
}
__device__ __forceinline__ void store_in4(e16_t* p, long long i, float4 v, long long lo_off) {
    const e16_t h0 = f32_to_e16(v.x), h1 = f32_to_e16(v.y), h2 = f32_to_e16(v.z), h3 = f32_to_e16(v.w);
    uint2 hi;
    hi.x = (unsigned int)h0 | ((unsigned int)h1 << 16);
    hi.y = (unsigned int)h2 | ((unsigned int)h3 << 16);
    *reinterpret_cast<uint2*>(p + i) = hi;
    if (lo_off != 0) {
        uint2 lo;
        lo.x = (unsigned int)f32_to_e16(v.x - e16_to_f32(h0)) | ((unsigned int)f32_to_e16(v.y - e16_to_f32(h1)) << 16);
        lo.y = (unsigned int)f32_to_e16(v.z - e16_to_f32(h2)) | ((unsigned int)f32_to_e16(v.w - e16_to_f32(h3)) << 16);
        *reinterpret_cast<uint2*>(p + i + lo_off) = lo;
    }
}

// A bf16 GEMM input written by the half-KV attention program (compiled with TANDEM_F16, so its
// pool, Q and P are IEEE half; TANDEM_HALF_KV) for the bf16x2 precision's GEMMs over bf16
// weights: split like store_in(e16_t*) of the bf16 program, whatever this program's element.
struct b16_t {
    unsigned short bits;
};
__device__ __forceinline__ void store_in(b16_t* p, long long i, float v, long long lo_off) {
    const unsigned short hi = f32_to_bf16_bits(v);
    p[i].bits = hi;
    if (lo_off != 0) p[i + lo_off].bits = f32_to_bf16_bits(v - bf16_bits_to_f32(hi));
}
__device__ __forceinline__ void store_in2(b16_t* p, long long i, float v0, float v1, long long lo_off) {
    const unsigned short h0 = f32_to_bf16_bits(v0), h1 = f32_to_bf16_bits(v1);
    *reinterpret_cast<unsigned int*>(p + i) = (unsigned int)h0 | ((unsigned int)h1 << 16);
    if (lo_off != 0) {
        *reinterpret_cast<unsigned int*>(p + i + lo_off) = (unsigned int)f32_to_bf16_bits(v0 - bf16_bits_to_f32(h0)) |
                                                           ((unsigned int)f32_to_bf16_bits(v1 - bf16_bits_to_f32(h1)) << 16);
    }
}

// FP8 e4m3 (kv/fp8.rs): the codes of an FP8 KV pool (`f8_t`, a type of its own so that the
// writers pick the quantising store), each (token, KV head) with an f32 scale after its part's
// slots. A head stores scale = amax / 448 and the codes of x * (448 / amax); both divisions
// are IEEE (NVRTC's prec-div), as on the CPU.
struct f8_t {
    unsigned char bits;
};
#define E4M3_MAX 448.0f

// The e4m3 code nearest to v (ties to even), saturated to ±448; NaN stays NaN.
__device__ __forceinline__ unsigned char f32_to_e4m3(float v) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 890)
    unsigned short r;
    // The first source goes to the upper byte, the second (v) to the lower.
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(v));
    return (unsigned char)(r & 0xffu);
#else
    if (v != v) return 0x7fu;
    const unsigned char sign = signbit(v) ? 0x80u : 0u;
    const float a = fabsf(v);
    unsigned code;
    if (a < 0.015625f) {  // subnormals: multiples of 2^-9
        code = (unsigned)__float2int_rn(a * 512.0f);
    } else if (a >= E4M3_MAX) {
        code = 0x7eu;
    } else {
        int e;
        const float f = frexpf(a, &e);  // a = f * 2^e, f in [0.5, 1)
        int m = __float2int_rn((2.0f * f - 1.0f) * 8.0f);
        e -= 1;
        if (m == 8) {
            m = 0;
            e += 1;
        }
        code = min((unsigned)(((e + 7) << 3) | m), 0x7eu);
    }
    return sign | (unsigned char)code;
#endif
}

// Two codes (the low byte the first element) as a pair of IEEE halves (the first in the low
// 16 bits), exactly: every e4m3 value is a half.
__device__ __forceinline__ unsigned e4m3x2_to_h2(unsigned short c) {
    unsigned r;
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 890)
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(c));
#else
    // Each code's sign and magnitude bits moved to a half's: the value / 256 for normals and
    // subnormals alike (bias 7 against 15), then × 256, exact.
    const unsigned v = c;
    const unsigned h = ((v & 0x7fu) << 7) | ((v & 0x80u) << 8) | ((v & 0x7f00u) << 15) | ((v & 0x8000u) << 16);
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(h), "r"(0x5c005c00u));
#endif
    return r;
}

#define NEG_INF __int_as_float(0xff800000)

// Programmatic dependent launch (sm_90 on): in a CUDA graph whose edges between these kernels
// are programmatic (graphs.rs), each kernel lets its own dependents launch, then waits until
// the kernels it depends on have completed and their writes are visible. Triggering before
// the wait lets launches run ahead by as many grids as the SMs hold at once, so a kernel's
// work before its wait (the decode attention's first runs of keys, the one-row GEMVs' first
// weights) overlaps more than the kernel just before it (batch 1 +2.7% with the early GEMV
// weights, which gained nothing when each kernel triggered after its wait). Every kernel of
// the program starts with it, and nothing before a wait writes memory another kernel reads;
// outside such graphs both instructions are no-ops.
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
#define GRID_DEPENDENCY_SYNC() asm volatile("griddepcontrol.launch_dependents;\n\tgriddepcontrol.wait;" ::: "memory")
#else
#define GRID_DEPENDENCY_SYNC()
#endif

// Sum of `v` over the warp; every lane gets the result.
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum of `v` over the whole block; every thread gets the result. blockDim.x must be a
// multiple of 32 (at most 1024) and every thread of the block must call it.
__device__ float block_sum(float v) {
    __shared__ float warp_sums[32];
    __shared__ float total;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    if (lane == 0) warp_sums[warp] = v;
    __syncthreads();
    if (warp == 0) {
        const int warps = (blockDim.x + 31) >> 5;
        float s = lane < warps ? warp_sums[lane] : 0.0f;
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == 0) total = s;
    }
    __syncthreads();
    const float r = total;
    __syncthreads();  // the next call may overwrite the shared slots
    return r;
}

// Maximum of `v` over the whole block, as block_sum (same conditions).
__device__ float block_max(float v) {
    __shared__ float warp_max[32];
    __shared__ float total;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    if (lane == 0) warp_max[warp] = v;
    __syncthreads();
    if (warp == 0) {
        const int warps = (blockDim.x + 31) >> 5;
        float s = lane < warps ? warp_max[lane] : 0.0f;
        for (int o = 16; o > 0; o >>= 1) s = fmaxf(s, __shfl_xor_sync(0xffffffffu, s, o));
        if (lane == 0) total = s;
    }
    __syncthreads();
    const float r = total;
    __syncthreads();
    return r;
}

// The factor a head of largest magnitude `amax` is multiplied by before its codes are taken
// (0 for a head of zeros), and the scale stored beside them.
__device__ __forceinline__ float e4m3_inv_scale(float amax) { return amax > 0.0f ? E4M3_MAX / amax : 0.0f; }
__device__ __forceinline__ float e4m3_scale(float amax) { return amax / E4M3_MAX; }

// Elements of one part (the K or V of one layer of one block) of a pool of T: its slots, and
// in an FP8 pool (bytes) the 4-byte scale of each (slot, KV head) after them.
template <typename T>
__device__ __forceinline__ long long kv_part_e(int block_size, long long kvd, int nkv) {
    return (long long)block_size * kvd;
}
template <>
__device__ __forceinline__ long long kv_part_e<f8_t>(int block_size, long long kvd, int nkv) {
    return (long long)block_size * (kvd + 4LL * nkv);
}

// Stores this thread's pair (j, j + half) of one head's row at `at` (threads with `active`).
// For an FP8 pool every thread of the block must call it: the head's largest magnitude is a
// block reduction, and thread 0 stores the scale at `sat`.
template <typename T>
__device__ __forceinline__ void store_kv_pair(T* pool, long long at, long long sat, int j, int half, bool active,
                                              float x, float y) {
    if (active) {
        store_f(pool, at + j, x);
        store_f(pool, at + j + half, y);
    }
}
__device__ __forceinline__ void store_kv_pair(f8_t* pool, long long at, long long sat, int j, int half,
                                              bool active, float x, float y) {
    const float amax = block_max(active ? fmaxf(fabsf(x), fabsf(y)) : 0.0f);
    const float inv = e4m3_inv_scale(amax);
    if (active) {
        pool[at + j].bits = f32_to_e4m3(x * inv);
        pool[at + j + half].bits = f32_to_e4m3(y * inv);
    }
    if (threadIdx.x == 0) *reinterpret_cast<float*>(&pool[sat]) = e4m3_scale(amax);
}
