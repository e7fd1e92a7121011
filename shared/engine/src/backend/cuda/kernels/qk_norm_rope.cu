// Per-head RMSNorm (Qwen3's q_norm / k_norm, optional) then RoPE, in place on the q and k
// heads of each fused qkv row: a row holds nq q heads, then nkv k heads, then nkv v heads,
// each head_dim long, rows `row_stride` apart. RoPE is Hugging Face's rotate_half convention:
// pairs (j, j + head_dim/2), angle = inv_freq[j] * pos computed in f32 (cpu_ops::rope_apply).
// With a pool (qk_norm_rope_kv_*), the k heads as rotated and the v heads as they are are also
// stored into the paged pool (kv_write.cu's address function): the KV write in the same
// launch. Two forms: for steps of fewer than 256 tokens (decode) and for every FP8 pool, a
// block per head — grid (tokens, nq + nkv, or nq + 2 * nkv with a pool), blockDim.x =
// head_dim/2 rounded up to a multiple of 32; for longer steps with a 16- or 32-bit pool (or
// none), a warp per head (qk_norm_rope_tokens_*, below).

// Where K or V head kh (the k heads 0 .. nkv, then the v heads) of token t is stored in the
// pool: `at`, the element its row starts at, and `scale_at`, the byte of its f32 scale after
// the block part's rows (used by FP8 pools only).
struct KvHeadAt {
    long long at, scale_at;
};
template <typename T>
__device__ __forceinline__ KvHeadAt kv_head_at(const int* token_block, const int* positions, int t, int kh, int nkv,
                                               int head_dim, int block_size, int layer, int num_layers) {
    const long long kvd = (long long)nkv * head_dim;
    const long long part_e = kv_part_e<T>(block_size, kvd, nkv);
    const long long slot = positions[t] % block_size;
    const long long part =
        ((long long)token_block[t] * num_layers + layer) * 2 * part_e + (kh >= nkv ? part_e : 0);
    return {part + slot * kvd + (long long)(kh % nkv) * head_dim,
            part + (long long)block_size * kvd + (slot * nkv + kh % nkv) * 4};
}

// Head h of token t, by the calling block (threads j < head_dim / 2 each rotate a pair; every
// thread of the block must call it: the norm is a block reduction). The head is read through
// L2 (`__ldcg`): the fused qkv GEMV calls this on values other blocks of its grid wrote.
// in_lo != 0: qkv is a split GEMM's unfolded output, its lo half in_lo elements on; each value
// is hi + lo (as fold_rows_f32 would leave it), the q and k heads written back folded.
template <typename T>
__device__ void qk_norm_rope_head(int t, int h, float* qkv, int row_stride, int nq, int nkv, int head_dim,
                                  const int* positions, const float* inv_freq, const float* q_norm,
                                  const float* k_norm, float eps, T* pool, const int* token_block, int block_size,
                                  int layer, int num_layers, long long in_lo) {
    const int half = head_dim / 2;
    float* v = qkv + (long long)t * row_stride + (long long)h * head_dim;
    const int j = threadIdx.x;
    const bool active = j < half;
    // This head's row in the pool: K for the k heads, V for the v heads (and in an FP8 pool
    // its scale at `sat`).
    long long at = -1, sat = -1;
    if (pool != nullptr && h >= nq) {
        const KvHeadAt kv =
            kv_head_at<T>(token_block, positions, t, h - nq, nkv, head_dim, block_size, layer, num_layers);
        at = kv.at;
        sat = kv.scale_at;
    }
    // Element i of the head, folded.
    auto load = [&](int i) { return in_lo != 0 ? __ldcg(v + i) + __ldcg(v + in_lo + i) : __ldcg(v + i); };
    if (at >= 0 && h >= nq + nkv) {  // a v head (uniform over the block): stored as is
        const float x = active ? load(j) : 0.0f;
        const float y = active ? load(j + half) : 0.0f;
        store_kv_pair(pool, at, sat, j, half, active, x, y);
        return;
    }
    float a = active ? load(j) : 0.0f;
    float b = active ? load(j + half) : 0.0f;
    const float* nw = h < nq ? q_norm : k_norm;
    if (nw != nullptr) {  // uniform over the block
        const float ss = block_sum(a * a + b * b);
        const float r = 1.0f / sqrtf(ss / (float)head_dim + eps);
        if (active) {
            a = nw[j] * (a * r);
            b = nw[j + half] * (b * r);
        }
    }
    float x = 0.0f, y = 0.0f;
    if (active) {
        const float angle = inv_freq[j] * (float)positions[t];
        float s, c;
        sincosf(angle, &s, &c);
        x = a * c - b * s;
        y = b * c + a * s;
        v[j] = x;
        v[j + half] = y;
    }
    if (at >= 0) store_kv_pair(pool, at, sat, j, half, active, x, y);  // uniform over the block
}

template <typename T>
__device__ void qk_norm_rope_impl(float* qkv, int row_stride, int nq, int nkv, int head_dim, const int* positions,
                                  const float* inv_freq, const float* q_norm, const float* k_norm, float eps,
                                  T* pool, const int* token_block, int block_size, int layer, int num_layers,
                                  long long in_lo) {
    qk_norm_rope_head<T>(blockIdx.x, blockIdx.y, qkv, row_stride, nq, nkv, head_dim, positions, inv_freq, q_norm,
                         k_norm, eps, pool, token_block, block_size, layer, num_layers, in_lo);
}

extern "C" __global__ void qk_norm_rope_f32(float* qkv, int row_stride, int nq, int head_dim,
                                            const int* positions, const float* inv_freq,
                                            const float* q_norm, const float* k_norm, float eps) {
    GRID_DEPENDENCY_SYNC();
    // No pool: every head past the q heads is a k head (the grid has nq + nkv of them).
    qk_norm_rope_impl<float>(qkv, row_stride, nq, 0, head_dim, positions, inv_freq, q_norm, k_norm, eps, nullptr,
                             nullptr, 0, 0, 0, 0);
}

#define QK_NORM_ROPE_KV(NAME, T)                                                                              \
    extern "C" __global__ void NAME(float* qkv, int row_stride, int nq, int nkv, int head_dim,                \
                                    const int* positions, const float* inv_freq, const float* q_norm,         \
                                    const float* k_norm, float eps, T* pool, const int* token_block,          \
                                    int block_size, int layer, int num_layers, long long in_lo) {             \
        GRID_DEPENDENCY_SYNC();                                                                               \
        qk_norm_rope_impl<T>(qkv, row_stride, nq, nkv, head_dim, positions, inv_freq, q_norm, k_norm, eps,    \
                             pool, token_block, block_size, layer, num_layers, in_lo);                        \
    }

QK_NORM_ROPE_KV(qk_norm_rope_kv_f32, float)
QK_NORM_ROPE_KV(qk_norm_rope_kv_bf16, e16_t)
QK_NORM_ROPE_KV(qk_norm_rope_kv_h16, h16_t)
QK_NORM_ROPE_KV(qk_norm_rope_kv_fp8, f8_t)

// The warp-per-head form, for steps of 256 tokens and more (prefill chunks) over a 16- or
// 32-bit pool or none: the same arguments and `heads`, the heads of a row it rotates (and
// stores). Grid (tokens), a block of W warps per token (the launcher's 8); warp w takes heads
// w, w + W, .... Lane l holds the pairs j = l + 32 i (i < QR_PAIRS: head_dim at most 256) and
// computes their sin and cos once for the token; the norm is a warp reduction, no block
// barriers. qk_norm_rope_kv_tokens_in16_*: the qkv rows in the program's 16-bit element (a GEMM
// that wrote its output rounded: the bf16 and f16 precisions' prefill chunks), `src`; the
// rotated q heads go to the f32 rows of `qkv` (the attention's input, same row stride), the
// k and v heads to the pool only.
#define QR_PAIRS 4

// Reads of a head's elements through L2, from f32 or 16-bit rows.
__device__ __forceinline__ float4 load_head4(const float* p) { return __ldcg(reinterpret_cast<const float4*>(p)); }
__device__ __forceinline__ float4 load_head4(const e16_t* p) {
    const uint2 v = __ldcg(reinterpret_cast<const uint2*>(p));
    return make_float4(e16_lo(v.x), e16_hi(v.x), e16_lo(v.y), e16_hi(v.y));
}
__device__ __forceinline__ float load_head1(const float* p) { return __ldcg(p); }
__device__ __forceinline__ float load_head1(const e16_t* p) { return e16_to_f32(__ldcg(p)); }

// Stores a head's row (lane's pairs x[i], y[i] at j, j + half) at `at` of the pool.
template <typename T>
__device__ __forceinline__ void store_kv_head(T* pool, long long at, int lane, int half,
                                              const float (&x)[QR_PAIRS], const float (&y)[QR_PAIRS]) {
#pragma unroll
    for (int i = 0; i < QR_PAIRS; ++i) {
        const int j = lane + 32 * i;
        if (j < half) {
            store_f(pool, at + j, x[i]);
            store_f(pool, at + j + half, y[i]);
        }
    }
}
// The warp-per-head form at head_dim 128 with 16-byte rows (the qkv row stride and the lo
// offset multiples of 4): lane l holds elements 4l .. 4l + 3 of a head as one float4, the
// first half's lanes (l < 16) the rotation's x values and the second half's its y values; a
// lane's partner values (64 elements away) come from lane l ^ 16 by shuffle. One load and one
// store of each head per lane, against four of each in the general form. `src` is the row read
// (`row` itself, or its 16-bit form); the rotated heads are written to `row`, the k heads only
// when it is also the row read.
// A rotated head's four values of a lane into its row: f32, or rounded to the 16-bit element.
__device__ __forceinline__ void store_head4(float* p, float a, float b, float c, float d) {
    *reinterpret_cast<float4*>(p) = make_float4(a, b, c, d);
}
__device__ __forceinline__ void store_head4(e16_t* p, float a, float b, float c, float d) {
    const e16_t h0 = f32_to_e16(a), h1 = f32_to_e16(b), h2 = f32_to_e16(c), h3 = f32_to_e16(d);
    *reinterpret_cast<uint2*>(p) =
        make_uint2((unsigned int)h0 | ((unsigned int)h1 << 16), (unsigned int)h2 | ((unsigned int)h3 << 16));
}

template <typename T, typename I, typename R>
__device__ void qk_norm_rope_tokens_hd128(const I* src, R* row, int t, int nq, int nkv, int heads,
                                          const float* inv_freq, const float* q_norm, const float* k_norm, float eps,
                                          T* pool, const int* token_block, const int* positions, int block_size,
                                          int layer, int num_layers, long long in_lo) {
    // 16-bit rows written in place take the q heads back alone (the k and v heads live in the
    // pool); f32 rows in place take the k heads too.
    const bool k_back = (const void*)src == (const void*)row && sizeof(R) == sizeof(float);
    const int lane = threadIdx.x & 31;
    const int e = 4 * lane;
    // sin and cos of this lane's four rotation angles (j = e mod 64), once for the token.
    const float pos = (float)positions[t];
    float sn[4], cs[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) sincosf(inv_freq[(e + i) & 63] * pos, &sn[i], &cs[i]);
    // x' = x c - y s on the first half, y' = y c + x s on the second.
    const float sign = lane < 16 ? -1.0f : 1.0f;
    const int warps = blockDim.x >> 5;
    for (int h = threadIdx.x >> 5; h < heads; h += warps) {
        R* v = row + (long long)h * 128;
        const I* sv = src + (long long)h * 128;
        float4 q = load_head4(sv + e);
        if (in_lo != 0) {
            const float4 l = load_head4(sv + in_lo + e);
            q.x += l.x;
            q.y += l.y;
            q.z += l.z;
            q.w += l.w;
        }
        float o[4] = {q.x, q.y, q.z, q.w};
        const bool is_v = pool != nullptr && h >= nq + nkv;  // uniform over the warp
        if (!is_v) {
            const float* nw = h < nq ? q_norm : k_norm;
            if (nw != nullptr) {
                const float r = 1.0f / sqrtf(warp_sum(o[0] * o[0] + o[1] * o[1] + o[2] * o[2] + o[3] * o[3]) /
                                                 128.0f +
                                             eps);
#pragma unroll
                for (int i = 0; i < 4; ++i) o[i] = nw[e + i] * (o[i] * r);
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const float partner = __shfl_xor_sync(0xffffffffu, o[i], 16);
                o[i] = o[i] * cs[i] + sign * partner * sn[i];
            }
            if (h < nq || k_back) store_head4(v + e, o[0], o[1], o[2], o[3]);
        }
        if (pool != nullptr && h >= nq) {  // a k or v head: its row in the pool
            const KvHeadAt kv = kv_head_at<T>(token_block, positions, t, h - nq, nkv, 128, block_size, layer, num_layers);
#pragma unroll
            for (int i = 0; i < 4; ++i) store_f(pool, kv.at + e + i, o[i]);
        }
    }
}

template <typename T, typename I>
__device__ void qk_norm_rope_tokens_impl(const I* src, float* qkv, int row_stride, int nq, int nkv, int heads,
                                         int head_dim, const int* positions, const float* inv_freq,
                                         const float* q_norm, const float* k_norm, float eps, T* pool,
                                         const int* token_block, int block_size, int layer, int num_layers,
                                         long long in_lo) {
    const int t = blockIdx.x;
    const bool in_place = (const void*)src == (const void*)qkv;
    if (head_dim == 128 && row_stride % 4 == 0 && in_lo % 4 == 0) {
        qk_norm_rope_tokens_hd128<T, I, float>(src + (long long)t * row_stride, qkv + (long long)t * row_stride, t, nq,
                                        nkv, heads, inv_freq, q_norm, k_norm, eps, pool, token_block, positions,
                                        block_size, layer, num_layers, in_lo);
        return;
    }
    const int lane = threadIdx.x & 31;
    const int half = head_dim / 2;
    // The token's rotation, once for all the heads this warp takes.
    const float pos = (float)positions[t];
    float sn[QR_PAIRS], cs[QR_PAIRS];
#pragma unroll
    for (int i = 0; i < QR_PAIRS; ++i) {
        const int j = lane + 32 * i;
        sn[i] = 0.0f;
        cs[i] = 0.0f;
        if (j < half) sincosf(inv_freq[j] * pos, &sn[i], &cs[i]);
    }
    float* row = qkv + (long long)t * row_stride;
    const int warps = blockDim.x >> 5;
    for (int h = threadIdx.x >> 5; h < heads; h += warps) {
        float* v = row + (long long)h * head_dim;
        const I* sv = src + (long long)t * row_stride + (long long)h * head_dim;
        // Element i of the head, folded.
        auto load = [&](int i) {
            return in_lo != 0 ? load_head1(sv + i) + load_head1(sv + in_lo + i) : load_head1(sv + i);
        };
        const bool write_back = h < nq || in_place;  // uniform over the warp
        float x[QR_PAIRS], y[QR_PAIRS];
#pragma unroll
        for (int i = 0; i < QR_PAIRS; ++i) {
            const int j = lane + 32 * i;
            x[i] = j < half ? load(j) : 0.0f;
            y[i] = j < half ? load(j + half) : 0.0f;
        }
        const bool is_v = pool != nullptr && h >= nq + nkv;  // uniform over the warp
        if (!is_v) {
            const float* nw = h < nq ? q_norm : k_norm;
            float r = 1.0f;
            if (nw != nullptr) {
                float ss = 0.0f;
#pragma unroll
                for (int i = 0; i < QR_PAIRS; ++i) ss += x[i] * x[i] + y[i] * y[i];
                r = 1.0f / sqrtf(warp_sum(ss) / (float)head_dim + eps);
            }
#pragma unroll
            for (int i = 0; i < QR_PAIRS; ++i) {
                const int j = lane + 32 * i;
                if (j < half) {
                    float a = x[i], b = y[i];
                    if (nw != nullptr) {
                        a = nw[j] * (a * r);
                        b = nw[j + half] * (b * r);
                    }
                    x[i] = a * cs[i] - b * sn[i];
                    y[i] = b * cs[i] + a * sn[i];
                    if (write_back) {
                        v[j] = x[i];
                        v[j + half] = y[i];
                    }
                }
            }
        }
        if (pool != nullptr && h >= nq) {  // a k or v head: its row in the pool
            const KvHeadAt kv =
                kv_head_at<T>(token_block, positions, t, h - nq, nkv, head_dim, block_size, layer, num_layers);
            store_kv_head(pool, kv.at, lane, half, x, y);
        }
    }
}

extern "C" __global__ void qk_norm_rope_tokens_f32(float* qkv, int row_stride, int nq, int heads, int head_dim,
                                            const int* positions, const float* inv_freq,
                                            const float* q_norm, const float* k_norm, float eps) {
    GRID_DEPENDENCY_SYNC();
    // No pool: every head past the q heads is a k head.
    qk_norm_rope_tokens_impl<float, float>(qkv, qkv, row_stride, nq, 0, heads, head_dim, positions, inv_freq, q_norm,
                                           k_norm, eps, nullptr, nullptr, 0, 0, 0, 0);
}

#define QK_NORM_ROPE_KV_TOKENS(NAME, T)                                                                              \
    extern "C" __global__ void NAME(float* qkv, int row_stride, int nq, int nkv, int heads, int head_dim,     \
                                    const int* positions, const float* inv_freq, const float* q_norm,         \
                                    const float* k_norm, float eps, T* pool, const int* token_block,          \
                                    int block_size, int layer, int num_layers, long long in_lo) {             \
        GRID_DEPENDENCY_SYNC();                                                                               \
        qk_norm_rope_tokens_impl<T, float>(qkv, qkv, row_stride, nq, nkv, heads, head_dim, positions, inv_freq,      \
                                           q_norm, k_norm, eps, pool, token_block, block_size, layer, num_layers,    \
                                           in_lo);                                                                   \
    }

QK_NORM_ROPE_KV_TOKENS(qk_norm_rope_kv_tokens_f32, float)
QK_NORM_ROPE_KV_TOKENS(qk_norm_rope_kv_tokens_bf16, e16_t)
QK_NORM_ROPE_KV_TOKENS(qk_norm_rope_kv_tokens_h16, h16_t)

// qk_norm_rope_kv_tokens_q16_bf16: the same at head_dim 128 (row strides a multiple of 4), the
// rotated q heads rounded back into 16-bit rows (`q16`: the launcher passes `src` itself) that
// the warpgroup prefill attention reads its Q tiles from as they are.
extern "C" __global__ void qk_norm_rope_kv_tokens_q16_bf16(const e16_t* src, e16_t* q16, int row_stride, int nq,
                                                           int nkv, int heads, int head_dim, const int* positions,
                                                           const float* inv_freq, const float* q_norm,
                                                           const float* k_norm, float eps, e16_t* pool,
                                                           const int* token_block, int block_size, int layer,
                                                           int num_layers) {
    GRID_DEPENDENCY_SYNC();
    const long long at = (long long)blockIdx.x * row_stride;
    qk_norm_rope_tokens_hd128<e16_t, e16_t, e16_t>(src + at, q16 + at, blockIdx.x, nq, nkv, heads, inv_freq, q_norm,
                                                   k_norm, eps, pool, token_block, positions, block_size, layer,
                                                   num_layers, 0);
}

// 16-bit rows in (`src`, never split), the q heads out to the f32 rows of `qkv`, K and V into a
// pool of the program's 16-bit element.
extern "C" __global__ void qk_norm_rope_kv_tokens_in16_bf16(const e16_t* src, float* qkv, int row_stride, int nq,
                                                            int nkv, int heads, int head_dim, const int* positions,
                                                            const float* inv_freq, const float* q_norm,
                                                            const float* k_norm, float eps, e16_t* pool,
                                                            const int* token_block, int block_size, int layer,
                                                            int num_layers) {
    GRID_DEPENDENCY_SYNC();
    qk_norm_rope_tokens_impl<e16_t, e16_t>(src, qkv, row_stride, nq, nkv, heads, head_dim, positions, inv_freq,
                                           q_norm, k_norm, eps, pool, token_block, block_size, layer, num_layers, 0);
}
