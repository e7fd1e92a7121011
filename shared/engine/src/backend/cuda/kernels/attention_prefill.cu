// Causal paged attention for prefill chunks on tensor cores (flash-attention 2 style), over a
// 16-bit pool (bf16, or f16 in the f16 program): the cached prefix and the chunk's own keys alike.
//
// Grid (tiles, nkv); block 4 warps. A tile is up to FA_BQ / group consecutive tokens of one
// sequence (`tiles` holds (first token, tokens) pairs); its FA_BQ rows are (token, q head)
// pairs of one KV head's group, 16 per warp. The block walks the keys in runs of FA_BK: the
// run's K and V rows are gathered from their blocks into shared memory by cp.async, double
// buffered (the next run loads while this one computes; dynamic shared memory of
// 2 stages × (K, V) × FA_BK × (HD + FA_PAD) bf16), the B fragments come from ldmatrix, and
// each warp computes its
// 16 × FA_BK scores with mma.sync (bf16 in, f32 out), masks them by each row's own causal and
// sliding-window limits, updates its running max / sum in registers, and adds P·V (P rounded
// to bf16) into f32 accumulators. The fragment layouts are those of m16n8k16 (PTX ISA), so
// the scores' accumulator fragment is reused as the A operand of P·V without a round trip
// through shared memory.
#define FA_BQ 64
#define FA_BK 64
#define FA_PAD 8

// Not volatile: a pure register operation, so the compiler may interleave independent ones.
__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32." E16_MMA_TYPE "." E16_MMA_TYPE ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8×8 b16 matrices from shared memory (rows addressed by lanes 8i..8i+7 for matrix i);
// .trans delivers them transposed.
__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], const void* row) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
__device__ __forceinline__ void ldsm_x4_t(unsigned (&r)[4], const void* row) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

// 16 bytes global → shared without a register round trip; zero-filled when !valid.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    const int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// 2^x in one instruction (ex2.approx, relative error ~2^-22; -inf gives 0): the tensor-core
// kernels keep scores in log2 units (scaled by log2 e), as flash-attention does, since expf
// costs a dozen instructions and their softmax runs once per 16 keys per warp.
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
#define LOG2E_F 1.4426950408889634f
#define LN2_F 0.6931471805599453f

__device__ __forceinline__ unsigned pack_e16(float lo, float hi) {
    return (unsigned)f32_to_e16(lo) | ((unsigned)f32_to_e16(hi) << 16);
}

// Q rows as A fragments (bf16), one per 16 columns of the head: q0 and q1 start this lane's
// fragment rows qr and qr + 8; the lane takes columns 2qc, 2qc + 1 and the same + 8.
template <int HD>
__device__ __forceinline__ void load_q_fragments(unsigned (&qa)[HD / 16][4], const float* q0, const float* q1) {
    const int qc = threadIdx.x & 3;
#pragma unroll
    for (int kc = 0; kc < HD / 16; ++kc) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const float* q = (i == 0 ? q0 : q1) + kc * 16 + 2 * qc;
            const float2 lo = *reinterpret_cast<const float2*>(q);
            const float2 hi = *reinterpret_cast<const float2*>(q + 8);
            qa[kc][i] = pack_e16(lo.x, lo.y);
            qa[kc][2 + i] = pack_e16(hi.x, hi.y);
        }
    }
}

// Moves a key's (block, offset) walk `step` keys on; true when it left its block (the caller
// then reads the new block's id from the table).
__device__ __forceinline__ bool walk_keys(int& blk, int& off, int step, int block_size) {
    off += step;
    if (off < block_size) return false;
    do {
        off -= block_size;
        ++blk;
    } while (off >= block_size);
    return true;
}

// Queues the K and V rows of keys k0 .. k0 + FA_BK of KV head g (zero past `end`) into one
// shared-memory slot ([FA_BK][HD + FA_PAD] of K, then of V) by cp.async and commits them as one
// group. Each thread copies one 16-byte column of every (blockDim / (HD / 8))-th key, walking
// the block table incrementally (one division per run, one table read per block crossed).
template <int HD, bool SKIP = false>
__device__ __forceinline__ void stage_kv_run(e16_t* slot, const e16_t* pool, const int* table, int k0, int end,
                                             int block_size, long long block_e, long long layer_off, long long kvd,
                                             long long part_e, int g, int skip = -1) {
    constexpr int ROW = HD + FA_PAD;
    constexpr int CHUNKS = HD / 8;
    const int key0 = threadIdx.x / CHUNKS;
    const int step = blockDim.x / CHUNKS;
    const int c = (threadIdx.x % CHUNKS) * 8;
    e16_t* sk = slot;
    e16_t* sv = slot + FA_BK * ROW;
    int p = k0 + key0;
    int blk = p / block_size;
    int off = p - blk * block_size;
    // Element offset of this thread's column in block `blk` (read from the table only while
    // keys remain: the table does not reach past the sequence's last block).
    const long long col = layer_off + (long long)g * HD + c;
    long long blk_at = p < end ? (long long)table[blk] * block_e + col : 0;
    for (int key = key0; key < FA_BK; key += step) {
        const bool ok = p < end;
        // Past the end: nothing is read (zero fill); the pool's start is a valid address.
        const long long at = ok ? blk_at + (long long)off * kvd : 0;
        if (!SKIP || p != skip) {  // with SKIP, key `skip` is left untouched (the caller copies it)
            cp_async16(sk + key * ROW + c, pool + at, ok);
            cp_async16(sv + key * ROW + c, pool + (ok ? at + part_e : 0), ok);
        }
        p += step;
        if (walk_keys(blk, off, step, block_size)) blk_at = p < end ? (long long)table[blk] * block_e + col : 0;
    }
    cp_async_commit();
}

// The pool element of the tensor-core kernels: the program's 16-bit element, or FP8 codes in
// the FP8-KV program (TANDEM_FP8_KV), whose runs are staged as bytes (stage_kv_run_fp8) and
// dequantised into one 16-bit slot (dequant_kv_run) before the same math reads them.
#ifdef TANDEM_FP8_KV
typedef f8_t kv_t;
#else
typedef e16_t kv_t;
#endif
// Bytes of the 16-bit slot (K and V runs of FA_BK keys) and of one FP8 run as staged: the K
// and V codes, then their FA_BK scales each.
#define FP8_WIDE_BYTES(HD) (2 * FA_BK * ((HD) + FA_PAD) * 2)
#define FP8_RAW_BYTES(HD) (2 * FA_BK * (HD) + 2 * FA_BK * 4)

// 4 bytes global → shared (the scales of an FP8 run); zero-filled when !valid.
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool valid) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    const int n = valid ? 4 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(d), "l"(src), "r"(n));
}

// stage_kv_run for an FP8 pool: the codes of keys k0 .. k0 + FA_BK of KV head g into `raw`
// ([FA_BK][HD] of K, then of V, then FA_BK K scales and FA_BK V scales), 16 bytes per copy,
// each key's scales by the thread holding its first column; zero past `end`. One group.
template <int HD, bool SKIP = false>
__device__ __forceinline__ void stage_kv_run_fp8(unsigned char* raw, const f8_t* pool8, const int* table, int k0,
                                                 int end, int block_size, long long block_e, long long layer_off,
                                                 long long kvd, long long part_e, int g, int skip = -1) {
    constexpr int CHUNKS = HD / 16;
    const unsigned char* pool = reinterpret_cast<const unsigned char*>(pool8);
    const int key0 = threadIdx.x / CHUNKS;
    const int step = blockDim.x / CHUNKS;
    const int c = (threadIdx.x % CHUNKS) * 16;
    const long long nkv = kvd / HD;
    unsigned char* rk = raw;
    unsigned char* rv = raw + FA_BK * HD;
    float* sc = reinterpret_cast<float*>(raw + 2 * FA_BK * HD);
    int p = k0 + key0;
    int blk = p / block_size;
    int off = p - blk * block_size;
    const long long col = layer_off + (long long)g * HD + c;
    const long long scol = layer_off + (long long)block_size * kvd + (long long)g * 4;
    long long blk_at = p < end ? (long long)table[blk] * block_e : 0;
    for (int key = key0; key < FA_BK; key += step) {
        const bool ok = p < end;
        if (!SKIP || p != skip) {
            const long long at = ok ? blk_at + col + (long long)off * kvd : 0;
            cp_async16(rk + key * HD + c, pool + at, ok);
            cp_async16(rv + key * HD + c, pool + (ok ? at + part_e : 0), ok);
            if (c == 0) {
                const long long sat = ok ? blk_at + scol + (long long)off * nkv * 4 : 0;
                cp_async4(sc + key, pool + sat, ok);
                cp_async4(sc + FA_BK + key, pool + (ok ? sat + part_e : 0), ok);
            }
        }
        p += step;
        if (walk_keys(blk, off, step, block_size)) blk_at = p < end ? (long long)table[blk] * block_e : 0;
    }
    cp_async_commit();
}

// Two codes times their scale as a pair of halves (the first in the low 16 bits): the value
// the f16 pool would hold for what the codes stand for (the product in f32, rounded once; two
// f16x2 multiplies measured no faster on an H100 and round twice).
__device__ __forceinline__ unsigned e4m3x2_scaled(unsigned short codes, float s) {
    const unsigned h = e4m3x2_to_h2(codes);
    const float lo = h16_to_f32((unsigned short)(h & 0xffffu)) * s;
    const float hi = h16_to_f32((unsigned short)(h >> 16)) * s;
    unsigned r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// A staged FP8 run (`raw`, as stage_kv_run_fp8 left it, complete) into the 16-bit slot `wide`
// ([FA_BK][HD + FA_PAD] of K, then of V, as stage_kv_run fills it), each value decoded and
// multiplied by its key's scale. Every thread of the block takes part; the caller syncs after.
template <int HD>
__device__ __forceinline__ void dequant_kv_run(e16_t* wide, const unsigned char* raw) {
    constexpr int ROW = HD + FA_PAD;
    constexpr int CHUNKS = HD / 16;
    const float* sc = reinterpret_cast<const float*>(raw + 2 * FA_BK * HD);
    for (int i = threadIdx.x; i < 2 * FA_BK * CHUNKS; i += blockDim.x) {
        const int part = i / (FA_BK * CHUNKS);
        const int key = (i / CHUNKS) % FA_BK;
        const int c = (i % CHUNKS) * 16;
        const uint4 v = *reinterpret_cast<const uint4*>(raw + part * FA_BK * HD + key * HD + c);
        const float s = sc[part * FA_BK + key];
        uint4 a, b;
        a.x = e4m3x2_scaled((unsigned short)(v.x & 0xffffu), s);
        a.y = e4m3x2_scaled((unsigned short)(v.x >> 16), s);
        a.z = e4m3x2_scaled((unsigned short)(v.y & 0xffffu), s);
        a.w = e4m3x2_scaled((unsigned short)(v.y >> 16), s);
        b.x = e4m3x2_scaled((unsigned short)(v.z & 0xffffu), s);
        b.y = e4m3x2_scaled((unsigned short)(v.z >> 16), s);
        b.z = e4m3x2_scaled((unsigned short)(v.w & 0xffffu), s);
        b.w = e4m3x2_scaled((unsigned short)(v.w >> 16), s);
        e16_t* dst = wide + (part * FA_BK + key) * ROW + c;
        *reinterpret_cast<uint4*>(dst) = a;
        *reinterpret_cast<uint4*>(dst + 8) = b;
    }
}

// The scores of a warp's 16 rows (Q as A fragments) against NT × 8 keys of a staged K slot,
// starting at row `sk` (ldmatrix matrices: (kc, lo 8 cols), (kc, hi 8), (kc+1, lo), (kc+1, hi)).
template <int HD, int NT>
__device__ __forceinline__ void qk_scores(float (&s)[NT][4], const unsigned (&qa)[HD / 16][4], const e16_t* sk) {
    constexpr int ROW = HD + FA_PAD;
    const int lane = threadIdx.x & 31;
    const int mi = lane >> 3;  // ldmatrix: the matrix this lane addresses
    const int mr = lane & 7;   // and its row
    // With few key tiles (decode) each tile's HD / 16 dependent mma are split over two
    // accumulators (even and odd k chunks) so that they overlap; with many tiles (prefill)
    // the tiles already do, and the registers are better spent elsewhere.
    constexpr bool PAIR = NT <= 2;
    float s2[PAIR ? NT : 1][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
        if constexpr (PAIR) s2[nt][0] = s2[nt][1] = s2[nt][2] = s2[nt][3] = 0.0f;
#pragma unroll
        for (int kc = 0; kc < HD / 16; kc += 2) {
            unsigned b[4];
            ldsm_x4(b, sk + (nt * 8 + mr) * ROW + kc * 16 + mi * 8);
            mma_16816(s[nt], qa[kc], b[0], b[1]);
            if constexpr (PAIR) {
                mma_16816(s2[nt], qa[kc + 1], b[2], b[3]);
            } else {
                mma_16816(s[nt], qa[kc + 1], b[2], b[3]);
            }
        }
        if constexpr (PAIR) {
#pragma unroll
            for (int e = 0; e < 4; ++e) s[nt][e] += s2[nt][e];
        }
    }
}

// One online-softmax step over masked, scaled scores in log2 units (-inf where masked; a lane's
// rows qr and qr + 8 in elements 0-1 and 2-3): the rows' maxima over the quad of lanes sharing a row,
// the running max m and sum l rescaled, s turned into exp(s - max), the accumulators o
// rescaled. A row with nothing visible yet stays empty.
template <int HD, int NT>
__device__ __forceinline__ void softmax_step(float (&s)[NT][4], float (&m)[2], float (&l)[2], float (&o)[HD / 8][4]) {
    float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], s[nt][e]);
    }
    float corr[2], base[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
        mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
        const float big = fmaxf(m[i], mx[i]);
        base[i] = big == NEG_INF ? 0.0f : big;
        corr[i] = fast_exp2(m[i] - base[i]);
        m[i] = big;
        l[i] *= corr[i];
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            s[nt][e] = fast_exp2(s[nt][e] - base[e >> 1]);
            l[e >> 1] += s[nt][e];
        }
    }
#pragma unroll
    for (int dn = 0; dn < HD / 8; ++dn) {
        o[dn][0] *= corr[0];
        o[dn][1] *= corr[0];
        o[dn][2] *= corr[1];
        o[dn][3] *= corr[1];
    }
}

// O += P·V for 16 keys (kc) of P's accumulator fragments, reused as A fragments, against the
// staged V rows from `sv` (B fragments by ldmatrix.trans: keys 0..8 / 8..16 of columns dn*8,
// then dn+1).
template <int HD, int NT>
__device__ __forceinline__ void pv_accumulate(float (&o)[HD / 8][4], const float (&s)[NT][4], int kc, const e16_t* sv) {
    constexpr int ROW = HD + FA_PAD;
    const int lane = threadIdx.x & 31;
    const int mi = lane >> 3;
    const int mr = lane & 7;
    const unsigned pa[4] = {pack_e16(s[2 * kc][0], s[2 * kc][1]), pack_e16(s[2 * kc][2], s[2 * kc][3]),
                            pack_e16(s[2 * kc + 1][0], s[2 * kc + 1][1]),
                            pack_e16(s[2 * kc + 1][2], s[2 * kc + 1][3])};
#pragma unroll
    for (int dn = 0; dn < HD / 8; dn += 2) {
        unsigned b[4];
        ldsm_x4_t(b, sv + (kc * 16 + (mi & 1) * 8 + mr) * ROW + (dn + (mi >> 1)) * 8);
        mma_16816(o[dn], pa, b[0], b[1]);
        mma_16816(o[dn + 1], pa, b[2], b[3]);
    }
}

template <typename O, int HD>
__device__ void attention_prefill_impl(O* out, const float* qkv, int row_stride, const kv_t* pool,
                                       const int* tables, const int* table_start, const int* positions,
                                       const int* lo_pos, const int* tiles, int nq, int nkv, int group,
                                       int block_size, int layer, int num_layers, float scale,
                                       long long lo_off) {
    constexpr int ROW = HD + FA_PAD;
    extern __shared__ __align__(16) unsigned char fa_smem[];
    // [stage][K or V][FA_BK][ROW]
    e16_t* smem = reinterpret_cast<e16_t*>(fa_smem);
    // Blocks in launch order take the tiles last-first, every KV head's tile before the
    // previous tile: the longest causal runs start first and the grid's tail is short ones.
    const int id = blockIdx.y * gridDim.x + blockIdx.x;
    const int g = id % gridDim.y;
    const int tile = gridDim.x - 1 - id / gridDim.y;
    const int tok0 = tiles[2 * tile];
    const int ntok = tiles[2 * tile + 1];
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int qr = lane >> 2;  // fragment row (and +8)
    const int qc = lane & 3;   // fragment column pair
    const long long kvd = (long long)nkv * HD;
    const long long part_e = kv_part_e<kv_t>(block_size, kvd, nkv);
    const long long layer_e = 2 * part_e;
    const long long block_e = (long long)num_layers * layer_e;

    // This thread's two rows (qr and qr + 8 of its warp's 16): token, head, key limits.
    int row_tok[2], row_head[2], row_pos[2], row_lo[2];
    bool row_ok[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int r = warp * 16 + qr + 8 * i;
        const int ti = r / group;
        row_ok[i] = ti < ntok;
        row_tok[i] = tok0 + min(ti, ntok - 1);
        row_head[i] = g * group + r % group;
        row_pos[i] = row_ok[i] ? positions[row_tok[i]] : -1;
        row_lo[i] = lo_pos[row_tok[i]];
    }
    int warp_pos = max(row_pos[0], row_pos[1]);
    for (int o = 16; o > 0; o >>= 1) warp_pos = max(warp_pos, __shfl_xor_sync(0xffffffffu, warp_pos, o));

    unsigned qa[HD / 16][4];
    load_q_fragments<HD>(qa, qkv + (long long)row_tok[0] * row_stride + (long long)row_head[0] * HD,
                         qkv + (long long)row_tok[1] * row_stride + (long long)row_head[1] * HD);

    float o[HD / 8][4];
#pragma unroll
    for (int dn = 0; dn < HD / 8; ++dn) o[dn][0] = o[dn][1] = o[dn][2] = o[dn][3] = 0.0f;
    float m[2] = {NEG_INF, NEG_INF};  // log2 units
    float l[2] = {0.0f, 0.0f};
    const float scale_log2 = scale * LOG2E_F;

    const int* table = tables + table_start[tok0];
    const int kbeg = lo_pos[tok0];
    const int kend = positions[tok0 + ntok - 1] + 1;
    const long long layer_off = (long long)layer * layer_e;
#ifdef TANDEM_FP8_KV
    // Two byte stages after one 16-bit slot (within the 16-bit program's two slots).
    unsigned char* raw = fa_smem + FP8_WIDE_BYTES(HD);
    auto stage = [&](int st, int k0) {
        stage_kv_run_fp8<HD>(raw + st * FP8_RAW_BYTES(HD), pool, table, k0, kend, block_size, block_e, layer_off,
                             kvd, part_e, g);
    };
#else
    auto stage = [&](int st, int k0) {
        stage_kv_run<HD>(smem + (long long)st * 2 * FA_BK * ROW, pool, table, k0, kend, block_size, block_e,
                         layer_off, kvd, part_e, g);
    };
#endif
    stage(0, kbeg);
    int st = 0;
    for (int k0 = kbeg; k0 < kend; k0 += FA_BK, st ^= 1) {
        if (k0 + FA_BK < kend) {
            stage(st ^ 1, k0 + FA_BK);  // the next run loads during this one
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
#ifdef TANDEM_FP8_KV
        dequant_kv_run<HD>(smem, raw + st * FP8_RAW_BYTES(HD));
        __syncthreads();
        const e16_t* sk = smem;
#else
        const e16_t* sk = smem + (long long)st * 2 * FA_BK * ROW;
#endif
        const e16_t* sv = sk + FA_BK * ROW;
        if (k0 <= warp_pos) {  // else every row of this warp is before the run
            float s[FA_BK / 8][4];
            qk_scores<HD, FA_BK / 8>(s, qa, sk);
            // Mask (each row's own causal and sliding-window limits) and scale; a run every
            // row of the warp sees whole is only scaled.
            const bool whole = __all_sync(0xffffffffu, k0 >= max(row_lo[0], row_lo[1]) &&
                                                           k0 + FA_BK - 1 <= min(row_pos[0], row_pos[1]));
            if (whole) {
#pragma unroll
                for (int nt = 0; nt < FA_BK / 8; ++nt) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) s[nt][e] *= scale_log2;
                }
            } else {
#pragma unroll
                for (int nt = 0; nt < FA_BK / 8; ++nt) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int i = e >> 1;
                        const int key = k0 + nt * 8 + 2 * qc + (e & 1);
                        const bool ok = key >= row_lo[i] && key <= row_pos[i];
                        s[nt][e] = ok ? s[nt][e] * scale_log2 : NEG_INF;
                    }
                }
            }
            softmax_step<HD, FA_BK / 8>(s, m, l, o);
#pragma unroll
            for (int kc = 0; kc < FA_BK / 16; ++kc) pv_accumulate<HD, FA_BK / 8>(o, s, kc, sv);
        }
        __syncthreads();  // this stage is refilled two runs on
    }

#pragma unroll
    for (int i = 0; i < 2; ++i) {
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        if (!row_ok[i]) continue;
        const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
        const long long at = ((long long)row_tok[i] * nq + row_head[i]) * HD + 2 * qc;
#pragma unroll
        for (int dn = 0; dn < HD / 8; ++dn) {
            store_in(out, at + dn * 8, o[dn][2 * i] * inv, lo_off);
            store_in(out, at + dn * 8 + 1, o[dn][2 * i + 1] * inv, lo_off);
        }
    }
}

#define ATTENTION_PREFILL(NAME, O, HD)                                                                     \
    extern "C" __global__ void __launch_bounds__(128, 3) NAME(                                                \
        O* out, const float* qkv, int row_stride, const kv_t* pool, const int* tables,                    \
        const int* table_start, const int* positions, const int* lo_pos, const int* tiles, int nq, int nkv, \
        int group, int block_size, int layer, int num_layers, float scale, long long lo_off) { GRID_DEPENDENCY_SYNC();             \
        attention_prefill_impl<O, HD>(out, qkv, row_stride, pool, tables, table_start, positions, lo_pos,  \
                                      tiles, nq, nkv, group, block_size, layer, num_layers, scale, lo_off); \
    }

ATTENTION_PREFILL(attention_prefill_f32_hd64, float, 64)
ATTENTION_PREFILL(attention_prefill_bf16_hd64, e16_t, 64)
ATTENTION_PREFILL(attention_prefill_f32_hd128, float, 128)
ATTENTION_PREFILL(attention_prefill_bf16_hd128, e16_t, 128)
#ifdef TANDEM_HALF_KV
// The half-KV program's split-bf16 outputs (see attention_decode.cu).
ATTENTION_PREFILL(attention_prefill_b16_hd64, b16_t, 64)
ATTENTION_PREFILL(attention_prefill_b16_hd128, b16_t, 128)
#endif
