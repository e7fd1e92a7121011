// The prefill attention of attention_prefill.cu on Hopper's warpgroup tensor-core instructions
// (wgmma, compiled only for sm_90a; head_dim 128): the same tiles, masks, online softmax and
// outputs, with both products issued by the whole block (one warpgroup of 4 warps) straight
// from shared memory instead of per-warp mma.sync fed by ldmatrix. Blocks take their tiles
// from a host-built schedule (prefill_schedule.rs) instead of one tile each: every block about
// the same number of key runs, long tiles cut into pieces whose last merges the others.
//
// A tile's WG_ROWS = 128 rows are two m64 blocks: warp w holds rows 16w .. 16w + 15 of each
// (the accumulator layout of wgmma m64nN: per n8 column tile the m16n8 fragment of
// mma.sync, so mask_block and softmax_step of attention_prefill.cu apply unchanged, and the
// scores' fragments are the A operand of P·V from registers). Q (the tile, rounded to the
// 16-bit type once) and each run's K and V sit in shared memory in wgmma's 128-byte swizzled
// layout: a [rows][HD] matrix is stored as HD / 64 regions of [rows][64] (128 bytes a row),
// the 16-byte chunk c of row r at r · 128 + ((c ^ r) % 8) · 16 within its region (regions
// 1024-byte aligned). Q and K are read K-major by Q·K^T (8 rows on: 1024 bytes; k16 steps 32
// bytes on within a region), V N-major by P·V (8 keys on: 1024 bytes; 64 columns on: a
// region). K and V of a key sit alike, so one copy routine stages both; 8 consecutive
// threads copy one key's 128 contiguous bytes into 8 distinct bank groups.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) && !defined(TANDEM_FP8_KV)

#define WG_ROWS 128

// The shared-memory matrix descriptor of wgmma for the 128-byte swizzle: the start address,
// the byte offset between core-matrix groups along the leading (lbo) and stride (sbo)
// dimensions, all in 16-byte units, and the layout type (1: 128-byte swizzle).
__device__ __forceinline__ unsigned long long wg_desc(const void* smem, unsigned lbo, unsigned sbo) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(smem);
    return (unsigned long long)((a >> 4) & 0x3fffu) | ((unsigned long long)((lbo >> 4) & 0x3fffu) << 16) |
           ((unsigned long long)((sbo >> 4) & 0x3fffu) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most N of this warpgroup's committed groups are pending (in commit order).
template <int N>
__device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Shared-memory writes of this thread (st.shared, cp.async) made visible to wgmma's reads.
__device__ __forceinline__ void fence_smem_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Tells the compiler that the accumulators change here (wgmma writes them asynchronously,
// between its issue and the wait): no read of them moves across this point.
template <int N>
__device__ __forceinline__ void wg_touch(float (&d)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[i][e])::"memory");
    }
}

#define WG_ACC4(d, j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
#define WG_ACC32(d) \
    WG_ACC4(d, 0), WG_ACC4(d, 1), WG_ACC4(d, 2), WG_ACC4(d, 3), WG_ACC4(d, 4), WG_ACC4(d, 5), WG_ACC4(d, 6), WG_ACC4(d, 7)
#define WG_ACC64(d)                                                                                                 \
    WG_ACC32(d), WG_ACC4(d, 8), WG_ACC4(d, 9), WG_ACC4(d, 10), WG_ACC4(d, 11), WG_ACC4(d, 12), WG_ACC4(d, 13), \
        WG_ACC4(d, 14), WG_ACC4(d, 15)
#define WG_REGS32                                                                                                    \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
    "%24, %25, %26, %27, %28, %29, %30, %31}"
#define WG_REGS64                                                                                                    \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
    "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, "  \
    "%46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"

// d (64 × 64, f32) = A·B (+ d when acc), A 64 × 16 and B 16 × 64 both K-major in shared memory.
__device__ __forceinline__ void wg_mma_ss_n64(float (&d)[8][4], unsigned long long da, unsigned long long db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32." E16_MMA_TYPE "." E16_MMA_TYPE " " WG_REGS32
        ", %32, %33, p, 1, 1, 0, 0;\n}\n"
        : WG_ACC32(d)
        : "l"(da), "l"(db), "r"(acc));
}

// d (64 × 128) += A·B, A 64 × 16 from registers (the m16n8k16 A fragment of each warp's 16
// rows), B 16 × 128 N-major in shared memory.
__device__ __forceinline__ void wg_mma_rs_n128(float (&d)[16][4], const unsigned (&a)[4], unsigned long long db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32." E16_MMA_TYPE "." E16_MMA_TYPE " " WG_REGS64
        ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
        : WG_ACC64(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

// Byte offset of chunk (r, c) (columns c·8 .. c·8 + 7) of a [ROWS][HD] 16-bit matrix in the
// swizzled layout.
template <int ROWS>
__device__ __forceinline__ int wg_chunk_at(int r, int c) {
    return (c >> 3) * (ROWS * 128) + (r << 7) + (((c ^ r) & 7) << 4);
}

// The tile's Q rows, rounded to the 16-bit type, into `sq`, in WG_Q_BATCHES batches of loads
// that each stay in flight while other work goes on (wg_load_q, then wg_store_q): thread t
// converts chunks t, t + 128, ... (chunk i: row i / (HD / 8), columns from (i % (HD / 8))·8).
// Row r is token r / group (rows past the tile's tokens repeat its last; nothing reads their
// results), q head g·group + r % group.
#define WG_Q_BATCHES 2
template <int HD>
struct WgQBatch {
    static constexpr int N = WG_ROWS * (HD / 8) / 128 / WG_Q_BATCHES;
    float4 v[N][2];
};

template <int HD>
__device__ __forceinline__ void wg_load_q(WgQBatch<HD>& q, int batch, const float* qkv, int row_stride, int tok0,
                                          int ntok, int g, int group) {
    constexpr int CH = HD / 8;
#pragma unroll
    for (int j = 0; j < WgQBatch<HD>::N; ++j) {
        const int i = threadIdx.x + (batch * WgQBatch<HD>::N + j) * 128;
        const int r = i / CH;
        const int ti = min(r / group, ntok - 1);
        const float* row = qkv + (long long)(tok0 + ti) * row_stride + (long long)(g * group + r % group) * HD;
        const float4* at = reinterpret_cast<const float4*>(row + (i % CH) * 8);
        q.v[j][0] = at[0];
        q.v[j][1] = at[1];
    }
}

template <int HD>
__device__ __forceinline__ void wg_store_q(unsigned char* sq, const WgQBatch<HD>& q, int batch) {
    constexpr int CH = HD / 8;
#pragma unroll
    for (int j = 0; j < WgQBatch<HD>::N; ++j) {
        const int i = threadIdx.x + (batch * WgQBatch<HD>::N + j) * 128;
        const float4 a = q.v[j][0], b = q.v[j][1];
        *reinterpret_cast<uint4*>(sq + wg_chunk_at<WG_ROWS>(i / CH, i % CH)) =
            make_uint4(pack_e16(a.x, a.y), pack_e16(a.z, a.w), pack_e16(b.x, b.y), pack_e16(b.z, b.w));
    }
}

// The pool element offsets of keys k0 .. k0 + n·FA_BK (-1 past `end`) at column `col` of each
// key's row (the layer's K part, KV head g): one per thread of the first n·FA_BK (key_at's runs
// are consecutive), so that staging a run costs its copies and no table walk.
__device__ __forceinline__ void wg_key_offsets(long long* key_at, const int* table, int k0, int end, int block_size,
                                               long long block_e, long long col, long long kvd, int n = 1) {
    const int t = threadIdx.x;
    if (t >= n * FA_BK) return;
    const int p = k0 + t;
    long long at = -1;
    if (p < end) {
        const int blk = p / block_size;
        at = (long long)table[blk] * block_e + col + (long long)(p - blk * block_size) * kvd;
    }
    key_at[t] = at;
}

// stage_kv_run in the swizzled layout: the K and V rows of a run's keys (their offsets in
// `key_at`, -1: zero fill) into `slot` (K's FA_BK × HD, then V's) by cp.async, one group.
// Thread t copies column chunk t % (HD / 8) of keys t / (HD / 8), then every
// 128 / (HD / 8)-th key on: 8 consecutive threads copy one key's 128 contiguous bytes.
template <int HD>
__device__ __forceinline__ void wg_stage_kv(unsigned char* slot, const e16_t* pool, const long long* key_at,
                                            long long part_e) {
    constexpr int CH = HD / 8;
    constexpr int RUN_BYTES = FA_BK * HD * 2;
    const int c = threadIdx.x % CH;
    const int step = blockDim.x / CH;
#pragma unroll 4
    for (int key = threadIdx.x / CH; key < FA_BK; key += step) {
        const long long a = key_at[key];
        const bool ok = a >= 0;
        const long long at = ok ? a + c * 8 : 0;
        unsigned char* d = slot + wg_chunk_at<FA_BK>(key, c);
        cp_async16(d, pool + at, ok);
        cp_async16(d + RUN_BYTES, pool + (ok ? at + part_e : 0), ok);
    }
    cp_async_commit();
}

// Issues the scores of m64 block b against a staged run, s = Q_b · K^T (64 × FA_BK) in HD / 16
// steps of k16, as one commit group (the caller fences before and waits after).
template <int HD>
__device__ __forceinline__ void wg_scores(float (&s)[FA_BK / 8][4], const unsigned char* sq, const unsigned char* sk,
                                          int b) {
#pragma unroll
    for (int kc = 0; kc < HD / 16; ++kc) {
        // k16 step kc: region kc / 4, 32 bytes per step within its rows; 8 rows on: 1024.
        const int k_at = (kc & 3) * 32;
        wg_mma_ss_n64(s, wg_desc(sq + (kc >> 2) * (WG_ROWS * 128) + b * 64 * 128 + k_at, 16, 1024),
                      wg_desc(sk + (kc >> 2) * (FA_BK * 128) + k_at, 16, 1024), kc > 0);
    }
    wg_commit();
}

// Issues O += P · V for one m64 block, as one commit group: P (the block's scores after
// softmax_step) rounded to the 16-bit type in the A fragment layout, V N-major from `sv`,
// FA_BK / 16 steps of k16 (the caller waits).
template <int HD>
__device__ __forceinline__ void wg_pv(float (&o)[HD / 8][4], const float (&s)[FA_BK / 8][4], const unsigned char* sv) {
    unsigned pa[FA_BK / 16][4];
#pragma unroll
    for (int kc = 0; kc < FA_BK / 16; ++kc) {
        pa[kc][0] = pack_e16(s[2 * kc][0], s[2 * kc][1]);
        pa[kc][1] = pack_e16(s[2 * kc][2], s[2 * kc][3]);
        pa[kc][2] = pack_e16(s[2 * kc + 1][0], s[2 * kc + 1][1]);
        pa[kc][3] = pack_e16(s[2 * kc + 1][2], s[2 * kc + 1][3]);
    }
    wg_touch(o);
    wg_fence();
#pragma unroll
    for (int kc = 0; kc < FA_BK / 16; ++kc) {
        // Keys kc·16 ..: 16 rows of 128 bytes on; 64 columns on: a region; 8 keys: 1024.
        const unsigned long long db = wg_desc(sv + kc * 16 * 128, FA_BK * 128, 1024);
        wg_mma_rs_n128(o, pa[kc], db);
    }
    wg_commit();
}

// A block's share of the launch: pieces of the schedule of prefill_schedule.rs (one tile's
// rows for one KV head, runs r0 .. r1 of the tile's keys; a tile cut into `parts` pieces
// keeps its partial states in slots slot0 .. slot0 + parts - 1, and its counter at slot0).
#define WG_PIECE_INTS 8
struct WgPiece {
    int tok0, ntok, g, r0, r1, slot0, part, parts;
};

// What every piece of a launch shares: the kernel's parameters (Q from the f32 rows of qkv,
// or from 16-bit rows already rounded: QT).
template <typename O, typename QT>
struct WgArgs {
    O* out;
    const QT* qkv;
    const e16_t* pool;
    const int *tables, *table_start, *positions, *lo_pos;
    int row_stride, nq, nkv, group, block_size, layer, num_layers;
    float scale;
    long long lo_off;
    float* states;
    int* counts;
};

// A partial state in its slot: per thread of the block, its accumulators (float4 k = b · HD / 8
// + dn at k · 128 + thread), then its rows' maxima and its part of their sums, so that each
// store and load of the block is one coalesced 2 KiB line (head_dim 128: 34 float4s a thread;
// prefill_schedule.rs sizes the slots alike).
#define WG_STATE_F4 34

__device__ __forceinline__ float4* wg_state(float* states, int slot) {
    return reinterpret_cast<float4*>(states) + (long long)slot * WG_STATE_F4 * 128;
}

template <int HD>
__device__ __forceinline__ void wg_save_state(float4* st, const float (&o)[2][HD / 8][4], const float (&m)[2][2],
                                              const float (&l)[2][2]) {
    const int t = threadIdx.x;
#pragma unroll
    for (int b = 0; b < 2; ++b) {
#pragma unroll
        for (int dn = 0; dn < HD / 8; ++dn) {
            __stcg(st + (b * (HD / 8) + dn) * 128 + t, make_float4(o[b][dn][0], o[b][dn][1], o[b][dn][2], o[b][dn][3]));
        }
    }
    __stcg(st + 2 * (HD / 8) * 128 + t, make_float4(m[0][0], m[0][1], m[1][0], m[1][1]));
    __stcg(st + (2 * (HD / 8) + 1) * 128 + t, make_float4(l[0][0], l[0][1], l[1][0], l[1][1]));
}

// Folds a sibling piece's saved state into this thread's (its keys are other runs of the same
// rows): both rescaled to the larger maximum (log2 units; a row empty in one part takes the
// other's), sums and accumulators added.
template <int HD>
__device__ __forceinline__ void wg_merge_state(const float4* st, float (&o)[2][HD / 8][4], float (&m)[2][2],
                                               float (&l)[2][2]) {
    const int t = threadIdx.x;
    const float4 sm = __ldcg(st + 2 * (HD / 8) * 128 + t);
    const float4 sl = __ldcg(st + (2 * (HD / 8) + 1) * 128 + t);
    const float om[4] = {sm.x, sm.y, sm.z, sm.w};
    const float ol[4] = {sl.x, sl.y, sl.z, sl.w};
    float fa[4], fb[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        float& mine = m[k >> 1][k & 1];
        const float big = fmaxf(mine, om[k]);
        fa[k] = mine == NEG_INF ? 0.0f : fast_exp2(mine - big);
        fb[k] = om[k] == NEG_INF ? 0.0f : fast_exp2(om[k] - big);
        mine = big;
        l[k >> 1][k & 1] = l[k >> 1][k & 1] * fa[k] + ol[k] * fb[k];
    }
#pragma unroll
    for (int b = 0; b < 2; ++b) {
#pragma unroll
        for (int dn = 0; dn < HD / 8; ++dn) {
            const float4 v = __ldcg(st + (b * (HD / 8) + dn) * 128 + t);
            o[b][dn][0] = o[b][dn][0] * fa[2 * b] + v.x * fb[2 * b];
            o[b][dn][1] = o[b][dn][1] * fa[2 * b] + v.y * fb[2 * b];
            o[b][dn][2] = o[b][dn][2] * fa[2 * b + 1] + v.z * fb[2 * b + 1];
            o[b][dn][3] = o[b][dn][3] * fa[2 * b + 1] + v.w * fb[2 * b + 1];
        }
    }
}

// The end of a cut tile's piece: its state saved, then the tile's counter counts it; the
// piece that finds every other part counted merges their states into its own and returns
// true (it stores the rows), the others return false. Nothing waits: the last to arrive
// merges. It resets the counter for the next launch.
template <typename A, int HD>
__device__ bool wg_finish_part(const A& a, const WgPiece& pc, float (&o)[2][HD / 8][4], float (&m)[2][2],
                               float (&l)[2][2]) {
    __shared__ int wg_last;
    wg_save_state<HD>(wg_state(a.states, pc.slot0 + pc.part), o, m, l);
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const bool last = atomicAdd(a.counts + pc.slot0, 1) == pc.parts - 1;
        if (last) {
            atomicExch(a.counts + pc.slot0, 0);
            __threadfence();
        }
        wg_last = last;
    }
    __syncthreads();
    if (!wg_last) return false;
    for (int q = 0; q < pc.parts; ++q) {
        if (q != pc.part) wg_merge_state<HD>(wg_state(a.states, pc.slot0 + q), o, m, l);
    }
    return true;
}

// What a piece's prologue needs: where its first two runs' key offsets go and the block table,
// its keys, the pool's layout, and where its Q rows are.
struct WgPrologue {
    long long* key_at;
    const int* table;
    const e16_t* pool;
    int kbeg, kend, block_size, row_stride, tok0, ntok, g, group;
    long long block_e, col, kvd, part_e;
};

// The prologue over f32 Q rows, in about three round trips: Q's first batch of loads beside the
// block table's two (the first two runs' key offsets, one thread per key), then Q's second
// batch beside the first run's copies. Its barrier also keeps the piece's staging behind every
// warp's last products of the piece before.
template <int HD>
__device__ __forceinline__ void wg_prologue(unsigned char* sq, unsigned char* skv, const float* qkv,
                                            const WgPrologue& p) {
    WgQBatch<HD> q;
    wg_load_q<HD>(q, 0, qkv, p.row_stride, p.tok0, p.ntok, p.g, p.group);
    wg_key_offsets(p.key_at, p.table, p.kbeg, p.kend, p.block_size, p.block_e, p.col, p.kvd, 2);
    __syncthreads();
    wg_stage_kv<HD>(skv, p.pool, p.key_at, p.part_e);
    wg_store_q<HD>(sq, q, 0);
    wg_load_q<HD>(q, 1, qkv, p.row_stride, p.tok0, p.ntok, p.g, p.group);
    wg_store_q<HD>(sq, q, 1);
}

// The prologue over 16-bit Q rows (rounded by the q/k norm kernel as the f32 form rounds them
// here): after the key offsets, Q's chunks go straight into the swizzled tile by cp.async
// beside the first run's, one more commit group.
template <int HD>
__device__ __forceinline__ void wg_prologue(unsigned char* sq, unsigned char* skv, const e16_t* q16,
                                            const WgPrologue& p) {
    constexpr int CH = HD / 8;
    wg_key_offsets(p.key_at, p.table, p.kbeg, p.kend, p.block_size, p.block_e, p.col, p.kvd, 2);
    __syncthreads();
    wg_stage_kv<HD>(skv, p.pool, p.key_at, p.part_e);
#pragma unroll 4
    for (int i = threadIdx.x; i < WG_ROWS * CH; i += 128) {
        const int r = i / CH;
        const int ti = min(r / p.group, p.ntok - 1);
        const e16_t* row = q16 + (long long)(p.tok0 + ti) * p.row_stride + (long long)(p.g * p.group + r % p.group) * HD;
        cp_async16(sq + wg_chunk_at<WG_ROWS>(r, i % CH), row + (i % CH) * 8, true);
    }
    cp_async_commit();
}

// One piece: the tile's Q rows staged, its runs r0 .. r1 of keys through the online softmax,
// then the rows stored (a whole tile, or the last part of a cut one to arrive) or the state
// saved for that last part.
template <typename O, typename QT, int HD>
__device__ void wg_piece(const WgArgs<O, QT>& a, const WgPiece& pc, unsigned char* sq, unsigned char* skv) {
    static_assert(HD == 128, "the warpgroup prefill serves head_dim 128 (P·V is one m64n128 per k16)");
    constexpr int NT = FA_BK / 8;
    constexpr int RUN_BYTES = FA_BK * HD * 2;
    const int g = pc.g, tok0 = pc.tok0, ntok = pc.ntok, group = a.group;
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int qr = lane >> 2;
    const long long kvd = (long long)a.nkv * HD;
    const long long part_e = kv_part_e<e16_t>(a.block_size, kvd, a.nkv);
    const long long layer_e = 2 * part_e;
    const long long block_e = (long long)a.num_layers * layer_e;

    // This thread's four rows: qr and qr + 8 of its warp's 16 in each m64 block.
    int row_pos[2][2], row_lo[2][2];
#pragma unroll
    for (int b = 0; b < 2; ++b) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int ti = (b * 64 + warp * 16 + qr + 8 * i) / group;
            const int t = tok0 + min(ti, ntok - 1);
            row_pos[b][i] = ti < ntok ? a.positions[t] : -1;
            row_lo[b][i] = a.lo_pos[t];
        }
    }

    const int* table = a.tables + a.table_start[tok0];
    const int tile_beg = a.lo_pos[tok0];
    const int kbeg = tile_beg + pc.r0 * FA_BK;
    const int kend = min(tile_beg + pc.r1 * FA_BK, a.positions[tok0 + ntok - 1] + 1);
    const long long col = (long long)a.layer * layer_e + (long long)g * HD;
    // The key offsets of the next two runs (run j's in key_at[j % 2]), each computed a run
    // ahead of its copies and published by the barrier between.
    __shared__ long long key_at[2][FA_BK];
    const WgPrologue pro{key_at[0], table,   a.pool, kbeg,   kend,    a.block_size, a.row_stride,
                         tok0,      ntok,    g,      group,  block_e, col,          kvd,
                         part_e};
    wg_prologue<HD>(sq, skv, a.qkv, pro);

    float o[2][HD / 8][4];
    float m[2][2], l[2][2];  // log2 units
    clear_online_softmax<HD>(o, m, l);
    const float scale_log2 = a.scale * LOG2E_F;
    int st = 0;
    for (int k0 = kbeg; k0 < kend; k0 += FA_BK, st ^= 1) {
        cp_async_wait<0>();
        fence_smem_async();
        // This run's keys (the first time, the Q tile too) and the next run's offsets are in;
        // every warp is past the last run's products, so its stage may be refilled.
        __syncthreads();
        if (k0 + FA_BK < kend) {
            wg_stage_kv<HD>(skv + (st ^ 1) * 2 * RUN_BYTES, a.pool, key_at[st ^ 1], part_e);
            wg_key_offsets(key_at[st], table, k0 + 2 * FA_BK, kend, a.block_size, block_e, col, kvd);
        }
        const unsigned char* sk = skv + st * 2 * RUN_BYTES;
        const unsigned char* sv = sk + RUN_BYTES;
        // Both blocks' scores issued at once; each block's softmax then runs while the tensor
        // cores work on the other's products (block 1's scores, then block 0's P·V).
        float s[2][NT][4];
        wg_fence();
        wg_scores<HD>(s[0], sq, sk, 0);
        wg_scores<HD>(s[1], sq, sk, 1);
        wg_wait<1>();
        wg_touch(s[0]);
        mask_block<NT>(s[0], k0, row_pos[0], row_lo[0]);
        softmax_step<HD, NT>(s[0], m[0], l[0], o[0], scale_log2);
        wg_pv<HD>(o[0], s[0], sv);
        wg_wait<1>();
        wg_touch(s[1]);
        mask_block<NT>(s[1], k0, row_pos[1], row_lo[1]);
        softmax_step<HD, NT>(s[1], m[1], l[1], o[1], scale_log2);
        wg_pv<HD>(o[1], s[1], sv);
        wg_wait<0>();
        wg_touch(o[0]);
        wg_touch(o[1]);
    }
    if (pc.parts > 1 && !wg_finish_part<WgArgs<O, QT>, HD>(a, pc, o, m, l)) return;

    const TileOut dst{tok0, g, group, a.nq, a.lo_off};
#pragma unroll
    for (int b = 0; b < 2; ++b) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            store_tile_row<O, HD>(a.out, dst, o[b], l[b][i], i, b * 64 + warp * 16 + qr + 8 * i, row_pos[b][i] >= 0);
        }
    }
}

// The launch: block b takes pieces sched[b] .. sched[b + 1] of the pieces after the gridDim.x + 1
// offsets.
template <typename O, typename QT, int HD>
__device__ void attention_prefill_wg_impl(const WgArgs<O, QT>& a, const int* sched) {
    extern __shared__ __align__(128) unsigned char wg_smem[];
    // [WG_ROWS][HD] of Q, then [stage][K or V][FA_BK][HD], swizzled, from a 1024-byte boundary
    // (the swizzle is of address bits; the launch adds 1024 bytes for the rounding).
    unsigned char* sq = wg_smem + ((1024u - ((unsigned)__cvta_generic_to_shared(wg_smem) & 1023u)) & 1023u);
    unsigned char* skv = sq + WG_ROWS * HD * 2;
    const int* pieces = sched + gridDim.x + 1;
    const int end = sched[blockIdx.x + 1];
    for (int i = sched[blockIdx.x]; i < end; ++i) {
        const int* p = pieces + (long long)i * WG_PIECE_INTS;
        const WgPiece pc{p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]};
        wg_piece<O, QT, HD>(a, pc, sq, skv);
    }
}

#define ATTENTION_PREFILL_WG(NAME, O, QT, HD)                                                                   \
    extern "C" __global__ void __launch_bounds__(128, 2)                                                       \
        NAME(O* out, const QT* qkv, int row_stride, const e16_t* pool, const int* tables,                      \
             const int* table_start, const int* positions, const int* lo_pos, const int* sched, int nq, int nkv, \
             int group, int block_size, int layer, int num_layers, float scale, long long lo_off, float* states, \
             int* counts) {                                                                                    \
        GRID_DEPENDENCY_SYNC();                                                                                \
        const WgArgs<O, QT> a{out,   qkv,        pool,       tables, table_start, positions, lo_pos, row_stride, \
                              nq,    nkv,        group,      block_size, layer, num_layers, scale, lo_off,      \
                              states, counts};                                                                 \
        attention_prefill_wg_impl<O, QT, HD>(a, sched);                                                        \
    }

// head_dim 128 only so far (the shape the GPU checks cover); head_dim 64 keeps mma.sync.
ATTENTION_PREFILL_WG(attention_prefill_wg_f32_hd128, float, float, 128)
ATTENTION_PREFILL_WG(attention_prefill_wg_bf16_hd128, e16_t, float, 128)
#ifdef TANDEM_HALF_KV
ATTENTION_PREFILL_WG(attention_prefill_wg_b16_hd128, b16_t, float, 128)
#else
// Q from the 16-bit rows of qk_norm_rope_kv_tokens_q16_bf16 (prefill steps without decode rows).
ATTENTION_PREFILL_WG(attention_prefill_wg_q16_bf16_hd128, e16_t, e16_t, 128)
#endif

#endif  // __CUDA_ARCH_FEAT_SM90_ALL && !TANDEM_FP8_KV
