// Greedy sampling on the device: out[r] = argmax of logits row r (vocab long), ties to the
// lowest index as the CPU sampler does; NaN never wins, a row of NaNs gives 0.
// Grid (rows, ARGMAX_SPLITS): each block scans a slice of the row (one block per row left a
// 151,936-wide row to a single SM, ~65 µs), writes its (max, index) to the scratch, and the
// block that finishes last merges the slices (an atomic counter per row, reset by it), so a
// step stays one launch.
#define ARGMAX_SPLITS 32

// In the f16 program a row holding NaN or +inf logits is an activation that left f16's range
// (±65,504) upstream: its token is -1, which the host turns into an error naming the cause,
// rather than a token drawn from garbage. (-inf is what masking writes; it is not counted.)
// Elsewhere such a row keeps the CPU's rule: NaN never wins.
#ifdef TANDEM_F16
#define OVERFLOW_CHECK 1
#else
#define OVERFLOW_CHECK 0
#endif
__device__ __forceinline__ bool nan_or_pos_inf(float v) { return !(v == v) || v == __int_as_float(0x7f800000); }

__device__ __forceinline__ void better(float& best, int& idx, float ob, int oi) {
    if (ob > best || (ob == best && oi < idx)) {
        best = ob;
        idx = oi;
    }
}

__device__ __forceinline__ void warp_argmax(float& best, int& idx) {
    for (int o = 16; o > 0; o >>= 1) {
        const float ob = __shfl_xor_sync(0xffffffffu, best, o);
        const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        better(best, idx, ob, oi);
    }
}

extern "C" __global__ void argmax_f32(int* out, const float* logits, int vocab, float* part_v, int* part_i,
                                      unsigned int* counters) {
    GRID_DEPENDENCY_SYNC();
    const int r = blockIdx.x;
    const int s = blockIdx.y;
    const float* row = logits + (long long)r * vocab;
    const int chunk = (vocab + ARGMAX_SPLITS - 1) / ARGMAX_SPLITS;
    const int lo = s * chunk;
    const int hi = min(vocab, lo + chunk);
    float best = NEG_INF;
    int idx = 0x7fffffff;
    bool bad = false;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        const float v = row[i];
        if (OVERFLOW_CHECK) bad |= nan_or_pos_inf(v);
        if (v > best) {  // strided scan: the first hit per thread is its lowest index
            best = v;
            idx = i;
        }
    }
    // -2: this slice of the row holds NaN or +inf (OVERFLOW_CHECK).
    if (OVERFLOW_CHECK && __syncthreads_or(bad)) idx = -2;
    warp_argmax(best, idx);
    __shared__ float sb[32];
    __shared__ int si[32];
    __shared__ bool last;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    if (lane == 0) {
        sb[warp] = best;
        si[warp] = idx;
    }
    __syncthreads();
    if (warp == 0) {
        const int warps = blockDim.x >> 5;
        best = lane < warps ? sb[lane] : NEG_INF;
        idx = lane < warps ? si[lane] : 0x7fffffff;
        warp_argmax(best, idx);
        if (lane == 0) {
            part_v[r * ARGMAX_SPLITS + s] = best;
            part_i[r * ARGMAX_SPLITS + s] = idx;
            __threadfence();
            last = atomicAdd(counters + r, 1u) == ARGMAX_SPLITS - 1;
        }
    }
    __syncthreads();
    if (!last || warp != 0) return;
    __threadfence();
    best = lane < ARGMAX_SPLITS ? __ldcg(part_v + r * ARGMAX_SPLITS + lane) : NEG_INF;
    idx = lane < ARGMAX_SPLITS ? __ldcg(part_i + r * ARGMAX_SPLITS + lane) : 0x7fffffff;
    const bool row_bad = OVERFLOW_CHECK && __any_sync(0xffffffffu, idx == -2);
    warp_argmax(best, idx);
    if (lane == 0) {
        out[r] = row_bad ? -1 : idx == 0x7fffffff ? 0 : idx;
        counters[r] = 0u;  // ready for the next launch
    }
}

// Sampling on the device, the CPU sampler's rules (sampler/mod.rs) row by row: penalties, the
// min_tokens mask, then argmax (greedy), or temperature, top-k, top-p, min-p and a draw with the
// uniform the engine took from the sequence's own RNG. One block of SAMPLE_THREADS per row;
// the row is rewritten in place (penalised, then scaled).
//
// The filters and the draw keep prefixes of the descending order (by value, ties to the lower
// id), found without sorting: a radix descent over the values' order-preserving 32-bit keys,
// 8 bits a level, with a count and an f64 probability mass per bin, then the ties of the last
// key resolved in id order. Masses are summed in another order than the CPU's sequential sums,
// so a uniform within ~1e-15 of a boundary may pick the neighbouring token.
#define SAMPLE_THREADS 1024

// Ascending as unsigned exactly when the floats ascend (NaNs aside).
__device__ __forceinline__ unsigned order_key(float x) {
    const unsigned b = __float_as_uint(x);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// A cut of the descending order: members before it have key > key, or key == key and id <= id.
struct SampleCut {
    unsigned key;
    int id;
};

__device__ __forceinline__ bool before_cut(const SampleCut& c, unsigned k, int i) {
    return k > c.key || (k == c.key && i <= c.id);
}

// Exclusive block scan of (count, mass) in thread order; returns this thread's prefix, and the
// totals through `tc` / `tm`.
__device__ void block_scan_cm(unsigned c, double m, unsigned& pc, double& pm, unsigned& tc, double& tm) {
    __shared__ unsigned sc[SAMPLE_THREADS];
    __shared__ double sm[SAMPLE_THREADS];
    sc[threadIdx.x] = c;
    sm[threadIdx.x] = m;
    __syncthreads();
    // Hillis-Steele inclusive scan.
    for (int o = 1; o < SAMPLE_THREADS; o <<= 1) {
        unsigned c2 = 0;
        double m2 = 0.0;
        if ((int)threadIdx.x >= o) {
            c2 = sc[threadIdx.x - o];
            m2 = sm[threadIdx.x - o];
        }
        __syncthreads();
        sc[threadIdx.x] += c2;
        sm[threadIdx.x] += m2;
        __syncthreads();
    }
    pc = sc[threadIdx.x] - c;
    pm = sm[threadIdx.x] - m;
    tc = sc[SAMPLE_THREADS - 1];
    tm = sm[SAMPLE_THREADS - 1];
    __syncthreads();
}

// The smallest prefix of the descending order over the members (member(i, key)) whose count
// reaches `want_count` (by_count) or whose mass reaches `target` (>= target, or > target with
// strict). When no prefix reaches it, the cut takes every member. mass(i) is the probability
// weight of element i.
template <typename Member, typename Mass>
__device__ SampleCut find_cut(const float* row, int vocab, Member member, Mass mass, bool by_count,
                              unsigned want_count, double target, bool strict) {
    __shared__ unsigned hc[256];
    __shared__ double hm[256];
    __shared__ unsigned s_prefix, s_above_c, s_found;
    __shared__ double s_above_m;
    __shared__ int s_id;
    auto reached = [&](unsigned c, double m) {
        return by_count ? c >= want_count : (strict ? m > target : m >= target);
    };
    if (threadIdx.x == 0) {
        s_prefix = 0u;
        s_above_c = 0u;
        s_above_m = 0.0;
        s_found = 1u;
    }
    for (int level = 0; level < 4; ++level) {
        const int shift = 24 - 8 * level;
        for (int b = threadIdx.x; b < 256; b += blockDim.x) {
            hc[b] = 0u;
            hm[b] = 0.0;
        }
        __syncthreads();
        const unsigned prefix = s_prefix;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            const unsigned k = order_key(row[i]);
            if (!member(i, k)) continue;
            if (level > 0 && (k >> (shift + 8)) != (prefix >> (shift + 8))) continue;
            const int b = (k >> shift) & 255u;
            atomicAdd(&hc[b], 1u);
            if (!by_count) atomicAdd(&hm[b], mass(i));
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            unsigned c = s_above_c;
            double m = s_above_m;
            int chosen = -1;
            int lowest = -1;
            for (int b = 255; b >= 0; --b) {
                if (hc[b] == 0u) continue;
                lowest = b;
                if (reached(c + hc[b], m + hm[b])) {
                    chosen = b;
                    break;
                }
                c += hc[b];
                m += hm[b];
            }
            if (chosen < 0) {
                // Not reached within this prefix: take all of it (the last non-empty bin,
                // its elements all before the cut).
                s_found = 0u;
                chosen = lowest < 0 ? 0 : lowest;
                // Undo the last bin's addition: it becomes the bin "containing" the cut.
                if (lowest >= 0) {
                    c -= hc[lowest];
                    m -= hm[lowest];
                }
            }
            s_prefix = prefix | ((unsigned)chosen << shift);
            s_above_c = c;
            s_above_m = m;
        }
        __syncthreads();
    }
    const unsigned key = s_prefix;
    const unsigned above_c = s_above_c;
    const double above_m = s_above_m;
    const bool found = s_found != 0u;
    // Ties at `key`, in id order: contiguous chunks per thread, scanned.
    const int chunk = (vocab + blockDim.x - 1) / blockDim.x;
    const int lo = threadIdx.x * chunk;
    const int hi = min(vocab, lo + chunk);
    unsigned c = 0u;
    double m = 0.0;
    int last_tie = -1;
    for (int i = lo; i < hi; ++i) {
        const unsigned k = order_key(row[i]);
        if (k == key && member(i, k)) {
            c += 1u;
            if (!by_count) m += mass(i);
            last_tie = i;
        }
    }
    unsigned pc, tc;
    double pm, tm;
    block_scan_cm(c, m, pc, pm, tc, tm);
    if (threadIdx.x == 0) s_id = -1;
    __syncthreads();
    if (!found) {
        // Every tie is before the cut: the bound is the largest tie id.
        if (last_tie >= 0) atomicMax(&s_id, last_tie);
    } else {
        unsigned cc = above_c + pc;
        double mm = above_m + pm;
        if (!reached(cc, mm) && reached(cc + c, mm + m)) {
            for (int i = lo; i < hi; ++i) {
                const unsigned k = order_key(row[i]);
                if (k == key && member(i, k)) {
                    cc += 1u;
                    if (!by_count) mm += mass(i);
                    if (reached(cc, mm)) {
                        s_id = i;
                        break;
                    }
                }
            }
        }
    }
    __syncthreads();
    SampleCut cut;
    cut.key = key;
    cut.id = s_id < 0 ? vocab : s_id;
    __syncthreads();
    return cut;
}

// fparams per row: temperature, top_p, min_p, repetition, frequency, presence (6 floats);
// iparams per row: greedy (0/1), top_k. Lists per row r: seen[seen_off[r] .. seen_off[r+1]]
// (distinct prompt and output ids, for the repetition penalty), counts (id, count) pairs of the
// output, masked ids (EOS and stop ids before min_tokens). allow_off[r] >= 0: row r follows a
// grammar whose allowed tokens are the bits of allowed[allow_off[r] ..] (bit i % 32 of word
// i / 32, (vocab + 31) / 32 words); every other token is masked.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) sample_rows_f32(
    int* out, float* logits, int vocab, const float* fparams, const int* iparams, const double* uniforms,
    const int* seen_off, const int* seen, const int* count_off, const int* counts, const int* mask_off,
    const int* masked, const int* allow_off, const unsigned* allowed, const int* bias_off,
    const int* biases) {
    GRID_DEPENDENCY_SYNC();
    const int r = blockIdx.x;
    float* row = logits + (long long)r * vocab;
    const float temperature = fparams[r * 6 + 0];
    const float top_p = fparams[r * 6 + 1];
    const float min_p = fparams[r * 6 + 2];
    const float rep = fparams[r * 6 + 3];
    const float freq = fparams[r * 6 + 4];
    const float pres = fparams[r * 6 + 5];
    const bool greedy = iparams[r * 2] != 0;
    const int top_k = iparams[r * 2 + 1];

    // 1. The logit bias ((id, f32 bits) pairs, distinct ids), penalties (repetition first, on
    // distinct ids; then frequency / presence), the masks.
    for (int i = bias_off[r] + threadIdx.x; i < bias_off[r + 1]; i += blockDim.x) {
        const int id = biases[2 * i];
        if (id >= 0 && id < vocab) row[id] += __int_as_float(biases[2 * i + 1]);
    }
    __syncthreads();
    if (rep != 1.0f) {
        for (int i = seen_off[r] + threadIdx.x; i < seen_off[r + 1]; i += blockDim.x) {
            const int id = seen[i];
            if (id < 0 || id >= vocab) continue;
            const float l = row[id];
            row[id] = l > 0.0f ? l / rep : l * rep;
        }
    }
    __syncthreads();
    if (freq != 0.0f || pres != 0.0f) {
        for (int i = count_off[r] + threadIdx.x; i < count_off[r + 1]; i += blockDim.x) {
            const int id = counts[2 * i];
            if (id < 0 || id >= vocab) continue;
            row[id] -= freq * (float)counts[2 * i + 1] + pres;
        }
    }
    __syncthreads();
    for (int i = mask_off[r] + threadIdx.x; i < mask_off[r + 1]; i += blockDim.x) {
        const int id = masked[i];
        if (id >= 0 && id < vocab) row[id] = NEG_INF;
    }
    if (allow_off[r] >= 0) {
        const unsigned* bits = allowed + allow_off[r];
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            if (((bits[i >> 5] >> (i & 31)) & 1u) == 0u) row[i] = NEG_INF;
        }
    }
    __syncthreads();

    __shared__ float s_max;
    __shared__ int s_pick;
    if (greedy) {
        // 2. Argmax, ties to the lowest id (the CPU's scan; NaN never wins).
        float best = NEG_INF;
        int idx = 0x7fffffff;
        bool bad = false;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            const float v = row[i];
            if (OVERFLOW_CHECK) bad |= nan_or_pos_inf(v);
            if (v > best) {
                best = v;
                idx = i;
            }
        }
        if (OVERFLOW_CHECK && __syncthreads_or(bad)) {
            if (threadIdx.x == 0) out[r] = -1;
            return;
        }
        __shared__ float sb[32];
        __shared__ int si[32];
        for (int o = 16; o > 0; o >>= 1) {
            const float ob = __shfl_xor_sync(0xffffffffu, best, o);
            const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
            if (ob > best || (ob == best && oi < idx)) {
                best = ob;
                idx = oi;
            }
        }
        if ((threadIdx.x & 31) == 0) {
            sb[threadIdx.x >> 5] = best;
            si[threadIdx.x >> 5] = idx;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int w = 0; w < (int)(blockDim.x >> 5); ++w) {
                if (sb[w] > best || (sb[w] == best && si[w] < idx)) {
                    best = sb[w];
                    idx = si[w];
                }
            }
            out[r] = idx == 0x7fffffff ? 0 : idx;
        }
        return;
    }

    // 3. Temperature (x * (1 / t) in f32, as the CPU), and the maximum.
    const float inv_t = 1.0f / temperature;
    float mx = NEG_INF;
    bool bad = false;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float v = row[i] * inv_t;
        if (OVERFLOW_CHECK) bad |= nan_or_pos_inf(v);
        row[i] = v;
        mx = fmaxf(mx, v);
    }
    if (OVERFLOW_CHECK && __syncthreads_or(bad)) {
        if (threadIdx.x == 0) out[r] = -1;
        return;
    }
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    __shared__ float smx[32];
    if ((threadIdx.x & 31) == 0) smx[threadIdx.x >> 5] = mx;
    __syncthreads();
    if (threadIdx.x == 0) {
        float m = NEG_INF;
        for (int w = 0; w < (int)(blockDim.x >> 5); ++w) m = fmaxf(m, smx[w]);
        s_max = m;
        s_pick = -1;
    }
    __syncthreads();
    const float maxv = s_max;
    const double u = uniforms[r];
    if (!(maxv > NEG_INF && maxv < __int_as_float(0x7f800000))) {
        if (threadIdx.x == 0) out[r] = 0;  // everything masked: the CPU's fallback
        return;
    }
    auto mass = [&](int i) { return exp((double)(row[i] - maxv)); };

    if (top_k <= 0 && top_p >= 1.0f && min_p <= 0.0f) {
        // 4a. Unfiltered: inverse CDF in id order over the whole row.
        const int chunk = (vocab + blockDim.x - 1) / blockDim.x;
        const int lo = threadIdx.x * chunk;
        const int hi = min(vocab, lo + chunk);
        double m = 0.0;
        int last = -1;
        for (int i = lo; i < hi; ++i) {
            const double p = mass(i);
            if (p > 0.0) {
                m += p;
                last = i;
            }
        }
        unsigned pc, tc;
        double pm, tm;
        block_scan_cm(0u, m, pc, pm, tc, tm);
        const double target = u * tm;
        if (pm <= target && target < pm + m) {
            double acc = pm;
            for (int i = lo; i < hi; ++i) {
                const double p = mass(i);
                if (p <= 0.0) continue;
                acc += p;
                if (target < acc) {
                    s_pick = i;
                    break;
                }
            }
        }
        __syncthreads();
        if (s_pick < 0 && last >= 0) atomicMax(&s_pick, last);  // rounding: the last weighted id
        __syncthreads();
        if (threadIdx.x == 0) out[r] = s_pick < 0 ? 0 : s_pick;
        return;
    }

    // 4b. Filtered: prefixes of the descending order.
    const SampleCut all = {0u, vocab};
    auto finite = [&](int i, unsigned k) { return row[i] > NEG_INF; };
    SampleCut ck = all;
    if (top_k > 0) {
        ck = find_cut(row, vocab, finite, mass, true, (unsigned)top_k, 0.0, false);
    }
    auto in_k = [&](int i, unsigned k) { return row[i] > NEG_INF && before_cut(ck, k, i); };
    SampleCut cp = all;
    if (top_p < 1.0f) {
        // The mass of the top-k set: one reduction.
        double m = 0.0;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            if (in_k(i, order_key(row[i]))) m += mass(i);
        }
        unsigned pc, tc;
        double pm, tm;
        block_scan_cm(0u, m, pc, pm, tc, tm);
        cp = find_cut(row, vocab, in_k, mass, false, 0u, (double)top_p * tm, false);
    }
    auto in_p = [&](int i, unsigned k) { return in_k(i, k) && before_cut(cp, k, i); };
    SampleCut cm = all;
    if (min_p > 0.0f) {
        // Relative to the largest probability, which is 1 here (exp(max - max)); at least one.
        if ((double)min_p > 1.0) {
            cm = find_cut(row, vocab, in_p, mass, true, 1u, 0.0, false);
        } else {
            const double thr = (double)min_p;
            auto below = [&](int i, unsigned k) { return in_p(i, k) && mass(i) < thr; };
            // The cut just before the first member under the threshold: count of those above.
            unsigned c = 0u;
            for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
                const unsigned k = order_key(row[i]);
                if (in_p(i, k) && !below(i, k)) c += 1u;
            }
            unsigned pc, tc;
            double pm, tm;
            block_scan_cm(c, 0.0, pc, pm, tc, tm);
            cm = find_cut(row, vocab, in_p, mass, true, tc > 0u ? tc : 1u, 0.0, false);
        }
    }
    auto kept = [&](int i, unsigned k) { return in_p(i, k) && before_cut(cm, k, i); };
    double m = 0.0;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        if (kept(i, order_key(row[i]))) m += mass(i);
    }
    unsigned pc, tc;
    double pm, tm;
    block_scan_cm(0u, m, pc, pm, tc, tm);
    // 5. The draw: the first kept element (descending) where the running mass passes u * total.
    const SampleCut cd = find_cut(row, vocab, kept, mass, false, 0u, u * tm, true);
    if (threadIdx.x == 0) out[r] = cd.id < vocab ? cd.id : 0;
    // A draw past the end (rounding) takes every kept element; its bound is the last tie id,
    // which find_cut returns as the cut's id.
}

// The most alternatives a row's logprobs carry (the API's top_logprobs limit).
#define LOGPROBS_MAX 20

// Logprobs of rows `sample_rows_f32` has just processed in place (penalised and masked, and
// scaled by 1 / temperature unless greedy): the CPU's log-softmax input. lp_k[r] < 0: none
// asked. Otherwise lp_out[r * (LOGPROBS_MAX + 1)] is the sampled token's (tokens[r])
// log-probability and lp_out[.. + 1 + j], lp_ids[r * LOGPROBS_MAX + j] the j-th most likely
// token of the lp_k[r] asked (descending, ties to the lowest id). Sums in f64 of
// exp(x - max) with the difference in f32, as the CPU.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) row_logprobs(
    const float* logits, int vocab, const int* tokens, const int* lp_k, float* lp_out, int* lp_ids) {
    GRID_DEPENDENCY_SYNC();
    const int r = blockIdx.x;
    const int k = min(lp_k[r], LOGPROBS_MAX);
    if (k < 0) return;
    const float* row = logits + (long long)r * vocab;
    float mx = NEG_INF;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) mx = fmaxf(mx, row[i]);
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    __shared__ float smx[32];
    __shared__ float s_max;
    if ((threadIdx.x & 31) == 0) smx[threadIdx.x >> 5] = mx;
    __syncthreads();
    if (threadIdx.x == 0) {
        float m = NEG_INF;
        for (int w = 0; w < (int)(blockDim.x >> 5); ++w) m = fmaxf(m, smx[w]);
        s_max = m;
    }
    __syncthreads();
    const float maxv = s_max;
    double s = 0.0;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float v = row[i];
        if (v > NEG_INF) s += exp((double)(v - maxv));
    }
    unsigned pc, tc;
    double pm, tm;
    block_scan_cm(0u, s, pc, pm, tc, tm);
    const double lse = (double)maxv + log(tm);
    float* out = lp_out + (long long)r * (LOGPROBS_MAX + 1);
    if (threadIdx.x == 0) {
        const int t = tokens[r];
        out[0] = (t >= 0 && t < vocab) ? (float)((double)row[t] - lse) : NEG_INF;
    }
    if (k == 0) return;
    // The k largest (ties to the lowest id), gathered, then ordered by one thread.
    auto every = [&](int i, unsigned key) { return true; };
    auto no_mass = [&](int i) { return 0.0; };
    const SampleCut cut = find_cut(row, vocab, every, no_mass, true, (unsigned)k, 0.0, false);
    __shared__ int s_n;
    __shared__ int s_ids[LOGPROBS_MAX];
    if (threadIdx.x == 0) s_n = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        if (before_cut(cut, order_key(row[i]), i)) {
            const int at = atomicAdd(&s_n, 1);
            if (at < LOGPROBS_MAX) s_ids[at] = i;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        const int n = min(min(s_n, k), LOGPROBS_MAX);
        for (int a = 1; a < n; ++a) {
            const int id = s_ids[a];
            const unsigned key = order_key(row[id]);
            int b = a - 1;
            while (b >= 0) {
                const unsigned kb = order_key(row[s_ids[b]]);
                if (kb > key || (kb == key && s_ids[b] < id)) break;
                s_ids[b + 1] = s_ids[b];
                --b;
            }
            s_ids[b + 1] = id;
        }
        int* ids = lp_ids + (long long)r * LOGPROBS_MAX;
        for (int j = 0; j < k; ++j) {
            const bool have = j < n;
            ids[j] = have ? s_ids[j] : -1;
            out[1 + j] = have ? (float)((double)row[s_ids[j]] - lse) : NEG_INF;
        }
    }
}
