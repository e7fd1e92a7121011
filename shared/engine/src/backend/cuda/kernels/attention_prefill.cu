// Causal paged attention for prefill chunks on tensor cores (flash-attention 2 style), over a
// 16-bit pool (bf16, or f16 in the f16 program): the cached prefix and the chunk's own keys alike.
//
// Grid (tiles, nkv); block 4 warps. A tile is up to FA_BQ / group consecutive tokens of one
// sequence (`tiles` holds (first token, tokens) pairs); its FA_BQ rows are (token, q head)
// pairs of one KV head's group, 32 per warp as two m16 row blocks, so that every K and V
// fragment a warp reads from shared memory feeds two mma. The tile's Q rows are rounded to
// the 16-bit type into shared memory once and read back by ldmatrix per 32 columns (held in
// registers they would not fit beside the two blocks' accumulators). The block walks the
// keys in runs of FA_BK: the run's K and V rows are gathered from their blocks into shared
// memory by cp.async, double buffered (the next run loads while this one computes; dynamic
// shared memory of the Q tile, then 2 stages × (K, V) × FA_BK × (HD + FA_PAD) 16-bit
// values), the B fragments come from ldmatrix, and each warp computes its 32 × FA_BK scores
// with mma.sync (16-bit in, f32 out), masks them by each row's own causal and sliding-window
// limits, updates its running max / sum in registers, and adds P·V (P rounded to the 16-bit
// type) into f32 accumulators. The fragment layouts are those of m16n8k16 (PTX ISA), so the
// scores' accumulator fragment is reused as the A operand of P·V without a round trip
// through shared memory.
#define FA_MB 2                     // m16 row blocks per warp
#define FA_WARP_ROWS (16 * FA_MB)  // rows per warp
#define FA_BQ (4 * FA_WARP_ROWS)     // rows per tile: 4 warps
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

// Two values rounded to the program's 16-bit type (nearest even) as a pair, `lo` in the low
// half: one instruction (f32_to_e16 is a dozen in bf16; NaN payloads are not kept).
__device__ __forceinline__ unsigned pack_e16(float lo, float hi) {
    unsigned r;
    asm("cvt.rn." E16_MMA_TYPE "x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// The tile's Q rows into shared memory ([FA_BQ][HD + FA_PAD], rounded to the 16-bit type),
// each warp its own FA_WARP_ROWS rows (rows past the tile's tokens repeat its last token; nothing reads
// their results). Row r is token r / group, q head g·group + r % group.
template <int HD>
__device__ __forceinline__ void stage_q_tile(e16_t* sq, const float* qkv, int row_stride, int tok0, int ntok, int g,
                                             int group) {
    constexpr int ROW = HD + FA_PAD;
    constexpr int PER = HD / 32;  // columns per lane
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
#pragma unroll 8
    for (int i = 0; i < FA_WARP_ROWS; ++i) {
        const int r = warp * FA_WARP_ROWS + i;
        const int ti = min(r / group, ntok - 1);
        const float* q = qkv + (long long)(tok0 + ti) * row_stride + (long long)(g * group + r % group) * HD + lane * PER;
        e16_t* d = sq + r * ROW + lane * PER;
        if constexpr (PER == 4) {
            const float4 v = *reinterpret_cast<const float4*>(q);
            *reinterpret_cast<uint2*>(d) = make_uint2(pack_e16(v.x, v.y), pack_e16(v.z, v.w));
        } else {
            const float2 v = *reinterpret_cast<const float2*>(q);
            *reinterpret_cast<unsigned*>(d) = pack_e16(v.x, v.y);
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

// The scores of a warp's 32 rows (two m16 blocks of Q from `sq`, the warp's first row)
// against NT × 8 keys of a staged K slot from row `sk`: per 32 columns, each block's A
// fragments by ldmatrix (matrices: rows 0-7 / 8-15 × columns lo / hi 8), then per key tile
// one ldmatrix of K (matrices: (kc, lo 8 cols), (kc, hi 8), (kc+1, lo), (kc+1, hi)) feeding
// both blocks' mma. Each score sums its column chunks in order, kc = 0, 1, ...
template <int HD, int NT>
__device__ __forceinline__ void qk_scores(float (&s)[FA_MB][NT][4], const e16_t* sq, const e16_t* sk) {
    constexpr int ROW = HD + FA_PAD;
    const int lane = threadIdx.x & 31;
    const int mi = lane >> 3;  // ldmatrix: the matrix this lane addresses
    const int mr = lane & 7;   // and its row
#pragma unroll
    for (int b = 0; b < FA_MB; ++b) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) s[b][nt][0] = s[b][nt][1] = s[b][nt][2] = s[b][nt][3] = 0.0f;
    }
#pragma unroll
    for (int kc = 0; kc < HD / 16; kc += 2) {
        unsigned qa[FA_MB][2][4];
#pragma unroll
        for (int b = 0; b < FA_MB; ++b) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                ldsm_x4(qa[b][h], sq + (b * 16 + (mi & 1) * 8 + mr) * ROW + (kc + h) * 16 + (mi >> 1) * 8);
            }
        }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            unsigned k[4];
            ldsm_x4(k, sk + (nt * 8 + mr) * ROW + kc * 16 + mi * 8);
#pragma unroll
            for (int b = 0; b < FA_MB; ++b) {
                mma_16816(s[b][nt], qa[b][0], k[0], k[1]);
                mma_16816(s[b][nt], qa[b][1], k[2], k[3]);
            }
        }
    }
}

// One online-softmax step over masked raw scores (-inf where masked; a lane's rows qr and
// qr + 8 in elements 0-1 and 2-3): the rows' maxima over the quad of lanes sharing a row,
// the running max m (log2 units: scores times scale_log2) and sum l rescaled, s turned into
// exp2(s · scale_log2 - max) (one fma per score), the accumulators o rescaled unless no row
// of the warp saw a new maximum. A row with nothing visible yet stays empty.
template <int HD, int NT>
__device__ __forceinline__ void softmax_step(float (&s)[NT][4], float (&m)[2], float (&l)[2], float (&o)[HD / 8][4],
                                             float scale_log2) {
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
        const float big = fmaxf(m[i], mx[i] * scale_log2);
        base[i] = big == NEG_INF ? 0.0f : big;
        corr[i] = fast_exp2(m[i] - base[i]);
        m[i] = big;
        l[i] *= corr[i];
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            s[nt][e] = fast_exp2(fmaf(s[nt][e], scale_log2, -base[e >> 1]));
            l[e >> 1] += s[nt][e];
        }
    }
    if (__all_sync(0xffffffffu, corr[0] == 1.0f && corr[1] == 1.0f)) return;
#pragma unroll
    for (int dn = 0; dn < HD / 8; ++dn) {
        o[dn][0] *= corr[0];
        o[dn][1] *= corr[0];
        o[dn][2] *= corr[1];
        o[dn][3] *= corr[1];
    }
}

// O += P·V for 16 keys (kc) of both row blocks' P accumulator fragments, reused as A
// fragments, against the staged V rows from `sv` (B fragments by ldmatrix.trans: keys 0..8 /
// 8..16 of columns dn*8, then dn+1; each feeds both blocks).
template <int HD, int NT>
__device__ __forceinline__ void pv_accumulate(float (&o)[FA_MB][HD / 8][4], const float (&s)[FA_MB][NT][4], int kc,
                                              const e16_t* sv) {
    constexpr int ROW = HD + FA_PAD;
    const int lane = threadIdx.x & 31;
    const int mi = lane >> 3;
    const int mr = lane & 7;
    unsigned pa[FA_MB][4];
#pragma unroll
    for (int b = 0; b < FA_MB; ++b) {
        pa[b][0] = pack_e16(s[b][2 * kc][0], s[b][2 * kc][1]);
        pa[b][1] = pack_e16(s[b][2 * kc][2], s[b][2 * kc][3]);
        pa[b][2] = pack_e16(s[b][2 * kc + 1][0], s[b][2 * kc + 1][1]);
        pa[b][3] = pack_e16(s[b][2 * kc + 1][2], s[b][2 * kc + 1][3]);
    }
#pragma unroll
    for (int dn = 0; dn < HD / 8; dn += 2) {
        unsigned v[4];
        ldsm_x4_t(v, sv + (kc * 16 + (mi & 1) * 8 + mr) * ROW + (dn + (mi >> 1)) * 8);
#pragma unroll
        for (int b = 0; b < FA_MB; ++b) {
            mma_16816(o[b][dn], pa[b], v[0], v[1]);
            mma_16816(o[b][dn + 1], pa[b], v[2], v[3]);
        }
    }
}

// Masks each row's keys outside [lo, pos] (its causal and sliding-window limits: -inf) in one
// m16 block of a warp's scores of keys k0 .. k0 + NT·8 (rows qr and qr + 8: pos[i], lo[i]);
// a run every row of the block sees whole is left as is.
template <int NT>
__device__ __forceinline__ void mask_block(float (&s)[NT][4], int k0, const int (&pos)[2], const int (&lo)[2]) {
    const int qc = threadIdx.x & 3;
    const int lo_max = max(lo[0], lo[1]);
    const int pos_min = min(pos[0], pos[1]);
    if (__all_sync(0xffffffffu, k0 >= lo_max && k0 + NT * 8 - 1 <= pos_min)) return;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int i = e >> 1;
            const int key = k0 + nt * 8 + 2 * qc + (e & 1);
            if (key < lo[i] || key > pos[i]) s[nt][e] = NEG_INF;
        }
    }
}

// The running state of the online softmax before the first run: O 0, max -inf, sum 0, for
// MB row blocks.
template <int HD, int MB>
__device__ __forceinline__ void clear_online_softmax(float (&o)[MB][HD / 8][4], float (&m)[MB][2], float (&l)[MB][2]) {
#pragma unroll
    for (int b = 0; b < MB; ++b) {
#pragma unroll
        for (int dn = 0; dn < HD / 8; ++dn) o[b][dn][0] = o[b][dn][1] = o[b][dn][2] = o[b][dn][3] = 0.0f;
        m[b][0] = m[b][1] = NEG_INF;
        l[b][0] = l[b][1] = 0.0f;
    }
}

// Where a finished tile's row goes: its first token and KV head, and the layout of `out`.
struct TileOut {
    int tok0, g, group, nq;
    long long lo_off;
};

// Row r of a finished tile: the lane's half `i` of accumulators o (its columns 2·qc, 2·qc + 1
// of every n8 tile) divided by the row's sum (the lane's part `l`, summed over the quad), into
// token tok0 + r / group, q head g·group + r % group, each pair of columns as one store. Every
// lane of the warp calls it (the sum is a warp shuffle); a row that is not `live` stores
// nothing.
template <typename O, int HD>
__device__ __forceinline__ void store_tile_row(O* out, const TileOut& t, const float (&o)[HD / 8][4], float l, int i,
                                               int r, bool live) {
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if (!live) return;
    const int qc = threadIdx.x & 3;
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    const long long at = ((long long)(t.tok0 + r / t.group) * t.nq + t.g * t.group + r % t.group) * HD + 2 * qc;
#pragma unroll
    for (int dn = 0; dn < HD / 8; ++dn) store_in2(out, at + dn * 8, o[dn][2 * i] * inv, o[dn][2 * i + 1] * inv, t.lo_off);
}

// The (KV head, tokens) of this block's tile. Blocks in launch order take the tiles in the
// order of `tiles` ((first token, tokens) per tile, ordered by the host: token_maps.rs), every
// KV head's tile before the next tile.
struct PrefillTile {
    int g, tok0, ntok;
};

__device__ __forceinline__ PrefillTile prefill_tile(const int* tiles) {
    const int id = blockIdx.y * gridDim.x + blockIdx.x;
    const int tile = id / gridDim.y;
    return PrefillTile{(int)(id % gridDim.y), tiles[2 * tile], tiles[2 * tile + 1]};
}

template <typename O, int HD>
__device__ void attention_prefill_impl(O* out, const float* qkv, int row_stride, const kv_t* pool,
                                       const int* tables, const int* table_start, const int* positions,
                                       const int* lo_pos, const int* tiles, int nq, int nkv, int group,
                                       int block_size, int layer, int num_layers, float scale,
                                       long long lo_off) {
    constexpr int ROW = HD + FA_PAD;
    constexpr int NT = FA_BK / 8;
    extern __shared__ __align__(16) unsigned char fa_smem[];
    // [FA_BQ][ROW] of Q, then [stage][K or V][FA_BK][ROW]
    e16_t* sq = reinterpret_cast<e16_t*>(fa_smem);
    e16_t* smem = sq + FA_BQ * ROW;
    const PrefillTile pt = prefill_tile(tiles);
    const int g = pt.g, tok0 = pt.tok0, ntok = pt.ntok;
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int qr = lane >> 2;  // fragment row (and +8)
    const long long kvd = (long long)nkv * HD;
    const long long part_e = kv_part_e<kv_t>(block_size, kvd, nkv);
    const long long layer_e = 2 * part_e;
    const long long block_e = (long long)num_layers * layer_e;

    // This thread's four rows (qr and qr + 8 of each of its warp's two blocks): their key
    // limits (a row past the tile's tokens sees nothing: pos -1).
    int row_pos[FA_MB][2], row_lo[FA_MB][2];
    int warp_pos = -1;
#pragma unroll
    for (int b = 0; b < FA_MB; ++b) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int ti = (warp * FA_WARP_ROWS + b * 16 + qr + 8 * i) / group;
            const int t = tok0 + min(ti, ntok - 1);
            row_pos[b][i] = ti < ntok ? positions[t] : -1;
            row_lo[b][i] = lo_pos[t];
            warp_pos = max(warp_pos, row_pos[b][i]);
        }
    }
    for (int o = 16; o > 0; o >>= 1) warp_pos = max(warp_pos, __shfl_xor_sync(0xffffffffu, warp_pos, o));

    const int* table = tables + table_start[tok0];
    const int kbeg = lo_pos[tok0];
    const int kend = positions[tok0 + ntok - 1] + 1;
    const long long layer_off = (long long)layer * layer_e;
#ifdef TANDEM_FP8_KV
    // Two byte stages after one 16-bit slot (within the 16-bit program's two slots).
    unsigned char* raw = reinterpret_cast<unsigned char*>(smem) + FP8_WIDE_BYTES(HD);
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
    stage(0, kbeg);  // the first run loads while Q is rounded into shared memory
    stage_q_tile<HD>(sq, qkv, row_stride, tok0, ntok, g, group);
    const e16_t* wq = sq + warp * FA_WARP_ROWS * ROW;

    float o[FA_MB][HD / 8][4];
    float m[FA_MB][2], l[FA_MB][2];  // log2 units
    clear_online_softmax<HD>(o, m, l);
    const float scale_log2 = scale * LOG2E_F;
    int st = 0;
    for (int k0 = kbeg; k0 < kend; k0 += FA_BK, st ^= 1) {
        if (k0 + FA_BK < kend) {
            stage(st ^ 1, k0 + FA_BK);  // the next run loads during this one
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();  // (the first time, the Q tile too)
#ifdef TANDEM_FP8_KV
        dequant_kv_run<HD>(smem, raw + st * FP8_RAW_BYTES(HD));
        __syncthreads();
        const e16_t* sk = smem;
#else
        const e16_t* sk = smem + (long long)st * 2 * FA_BK * ROW;
#endif
        const e16_t* sv = sk + FA_BK * ROW;
        if (k0 <= warp_pos) {  // else every row of this warp is before the run
            float s[FA_MB][NT][4];
            qk_scores<HD, NT>(s, wq, sk);
#pragma unroll
            for (int b = 0; b < FA_MB; ++b) {
                mask_block<NT>(s[b], k0, row_pos[b], row_lo[b]);
                softmax_step<HD, NT>(s[b], m[b], l[b], o[b], scale_log2);
            }
#pragma unroll
            for (int kc = 0; kc < FA_BK / 16; ++kc) pv_accumulate<HD, NT>(o, s, kc, sv);
        }
        __syncthreads();  // this stage is refilled two runs on
    }

    const TileOut dst{tok0, g, group, nq, lo_off};
#pragma unroll
    for (int b = 0; b < FA_MB; ++b) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            store_tile_row<O, HD>(out, dst, o[b], l[b][i], i, warp * FA_WARP_ROWS + b * 16 + qr + 8 * i,
                                  row_pos[b][i] >= 0);
        }
    }
}

#define ATTENTION_PREFILL(NAME, O, HD)                                                                     \
    extern "C" __global__ void __launch_bounds__(128, 2) NAME(                                                \
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
