// One chunk of paged attention on AVX-512 (included by kernels.c when compiled for it): the
// contract of attention_avx2.h's tiles (part[g] = {max, sum, out[D]} over n <= ATT_CHUNK keys)
// with 16-wide vectors, for D % 16 == 0, in two steps: the scores of a token's group heads, or of
// consecutive tokens' one head where a KV head serves one query head (qk_rows, softmax_rows), then
// the weighted V sums of the rows of the tokens that read the same keys (attend_values16).
//
// q . k: each (head, key)'s D products folded into one vector, then 16 such vectors summed across
// their lanes together (hsum16x16) into one vector of scores; up to four rows (heads of a token,
// or tokens of one head) share each K row's load (and conversion from float16). The weighted sum of V runs several rows in one
// pass over the V rows (a row loaded and converted once for all of them). The order of every
// operation of a row is fixed by n and D alone, so a token's result does not depend on its batch,
// its neighbours in a block or the threads.

// Lane order of hsum16x16's result: lane i holds the sum of input perm16[i] (an involution).
static const int perm16[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};

// The 16 lane sums of a[0..15]: lane i = sum of a[perm16[i]]'s lanes.
static inline __attribute__((always_inline)) __m512 hsum16x16(const __m512 *a) {
    __m512 x[8], y[4], z[2];
    for (int r = 0; r < 8; r++)
        x[r] = _mm512_add_ps(_mm512_shuffle_f32x4(a[r], a[r + 8], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(a[r], a[r + 8], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int r = 0; r < 4; r++)
        y[r] = _mm512_add_ps(_mm512_shuffle_f32x4(x[r], x[r + 4], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(x[r], x[r + 4], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int r = 0; r < 2; r++)
        z[r] = _mm512_add_ps(_mm512_shuffle_ps(y[r], y[r + 2], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(y[r], y[r + 2], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// Elements i .. i + 15 of the K or V row at element off of a cache of format fmt (KV_*; int8:
// the codes times their block's scale, which starts D bytes into the row).
static inline __attribute__((always_inline)) __m512 v16(const void *v, size_t off, size_t i, int fmt, int D) {
    if (fmt == KV_I8)
        return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)v + off + i)))),
                             _mm512_set1_ps(kv_block_scale(v, off, D, (int)(i / KV_I8_BLOCK))));
    return fmt == KV_F16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)v + off + i)))
                         : _mm512_loadu_ps((const float *)v + off + i);
}

#define ATT_GROUP_BATCH 8  // heads whose exponentials run in one loop
#define PV_REGS 24  // accumulators of the weighted V sum: PV_REGS / (D / 16) rows a pass, at most PV_ROWS
#define PV_ROWS 6
#define PF_LINES_QK 4  // lines pf_drain prefetches a vector of scores, and a V row of a pass
#define PF_LINES_PV 3

// Scores of hg rows (queries at q + h * qs: a token's heads, qs = D, or the one head of
// consecutive tokens, qs = the token stride) for keys off[0 .. n) into s[h * ATT_CHUNK + j]: kpr =
// 16 / hg keys a vector of sums, lane i of it head i / kpr's key i % kpr (lanes past hg * kpr idle).
// Each (head, key)'s D products are folded to 16 lanes (16 at a time, in order) and summed by hsum16x16's
// tree, which sums every input the same way wherever it sits; so a score's bits do not depend on
// hg. Inlined with constant hg.
static inline __attribute__((always_inline)) void qk_heads(const float *q, size_t qs, int D, const void *k,
                                                            const size_t *off, int fmt, int n, int hg, float scale,
                                                            float *s, att_prefetch *pf) {
    const int w = D / 16, kpr = 16 / hg;
    for (int j0 = 0; j0 < n; j0 += kpr) {
        __m512 a[16];
        const int nk = n - j0 < kpr ? n - j0 : kpr;
#pragma GCC unroll 16
        for (int r = 0; r < 16; r++) a[r] = _mm512_setzero_ps();
#pragma GCC unroll 16
        for (int j = 0; j < kpr; j++) {  // (constant bounds: a[] stays in registers)
            if (j >= nk) continue;
            __m512 x[4];
            __m512 kv = v16(k, off[j0 + j], 0, fmt, D);
            for (int h = 0; h < hg; h++) x[h] = _mm512_mul_ps(_mm512_loadu_ps(q + h * qs), kv);
            for (int i = 1; i < w; i++) {
                kv = v16(k, off[j0 + j], 16 * (size_t)i, fmt, D);
                for (int h = 0; h < hg; h++) x[h] = _mm512_fmadd_ps(_mm512_loadu_ps(q + h * qs + 16 * i), kv, x[h]);
            }
            for (int h = 0; h < hg; h++) a[perm16[h * kpr + j]] = x[h];
        }
        pf_drain(pf, PF_LINES_QK);
        const __m512 sv = _mm512_mul_ps(hsum16x16(a), _mm512_set1_ps(scale));
        if (hg == 1) {
            _mm512_storeu_ps(s + j0, sv);  // (lanes past n: zeros, never read)
            continue;
        }
        for (int h = 0; h < hg; h++)  // lanes h * kpr .. + nk - 1 to s[h * ATT_CHUNK + j0 ..]
            _mm512_mask_storeu_ps(s + (size_t)h * ATT_CHUNK + j0 - h * kpr, (__mmask16)(((1u << nk) - 1) << (h * kpr)), sv);
    }
}

// One pass of the weighted V sum for hg heads (g0 ..), the accumulators in registers:
// part[g].out[i0 * 16 ..] for wi vectors of the row. Inlined with constant hg and wi.
static inline __attribute__((always_inline)) void pv_pass(const void *v, const size_t *voff, int fmt, int D, int n,
                                                           const float *p, int hg, int i0, int wi, float *out,
                                                           size_t part_len, att_prefetch *pf) {
    __m512 acc[PV_REGS];
    for (int r = 0; r < PV_REGS; r++) acc[r] = _mm512_setzero_ps();
    for (int j = 0; j < n; j++) {
        pf_drain(pf, PF_LINES_PV);
        for (int i = 0; i < wi; i++) {
            const __m512 vi = v16(v, voff[j], 16 * (size_t)(i0 + i), fmt, D);
            for (int g = 0; g < hg && g * wi + i < PV_REGS; g++)  // (hg * wi <= PV_REGS: the bound is for gcc)
                acc[g * wi + i] = _mm512_fmadd_ps(_mm512_set1_ps(p[(size_t)g * ATT_CHUNK + j]), vi, acc[g * wi + i]);
        }
    }
    for (int g = 0; g < hg; g++)
        for (int i = 0; i < wi && g * wi + i < PV_REGS; i++)
            _mm512_storeu_ps(out + g * part_len + 16 * (size_t)(i0 + i), acc[g * wi + i]);
}

// Scores of rows rows (queries at q + r * qs) for keys off[0 .. n) into scores[r * ATT_CHUNK + j],
// up to four rows at a time (each K row loaded and converted once for them), 16 / hg keys of each
// in one vector of sums.
static inline __attribute__((always_inline)) void qk_rows(const float *q, size_t qs, int rows, int D, float scale,
                                                           const void *k, const size_t *off, int fmt, int n,
                                                           float *scores, att_prefetch *pf) {
    for (int g = 0; g < rows;) {
        const int hg = rows - g >= 4 ? 4 : rows - g;
        const float *qg = q + g * qs;
        float *sg = scores + (size_t)g * ATT_CHUNK;
        switch (hg) {  // constant row counts: the accumulators stay in registers
            case 1: qk_heads(qg, qs, D, k, off, fmt, n, 1, scale, sg, pf); break;
            case 2: qk_heads(qg, qs, D, k, off, fmt, n, 2, scale, sg, pf); break;
            case 3: qk_heads(qg, qs, D, k, off, fmt, n, 3, scale, sg, pf); break;
            default: qk_heads(qg, qs, D, k, off, fmt, n, 4, scale, sg, pf); break;
        }
        g += hg;
    }
}

// Rows rows of n scores (at scores[r * ATT_CHUNK + j]) as exp(score - max) in place, and part[r *
// part_len] = {max, sum}: the lanes past n masked out of the max and the sum, up to
// ATT_GROUP_BATCH rows' vectors in one loop (their exponentials independent, in flight together),
// each row's sum in order of j0.
static inline __attribute__((always_inline)) void softmax_rows(float *scores, int rows, int n, float *part,
                                                                size_t part_len) {
    for (int g0 = 0; g0 < rows; g0 += ATT_GROUP_BATCH) {
        const int hg = rows - g0 < ATT_GROUP_BATCH ? rows - g0 : ATT_GROUP_BATCH;
        float mx[ATT_GROUP_BATCH];
        __m512 sum[ATT_GROUP_BATCH];
        for (int g = 0; g < hg; g++) {
            const float *sg = scores + (size_t)(g0 + g) * ATT_CHUNK;
            __m512 mv = _mm512_set1_ps(-INFINITY);
            for (int j0 = 0; j0 < n; j0 += 16) {
                const __mmask16 live = n - j0 >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j0)) - 1);
                mv = _mm512_mask_max_ps(mv, live, mv, _mm512_loadu_ps(sg + j0));
            }
            mx[g] = _mm512_reduce_max_ps(mv);
            sum[g] = _mm512_setzero_ps();
        }
        for (int j0 = 0; j0 < n; j0 += 16) {
            const __mmask16 live = n - j0 >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j0)) - 1);
            for (int g = 0; g < hg; g++) {
                float *sg = scores + (size_t)(g0 + g) * ATT_CHUNK + j0;
                const __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_loadu_ps(sg), _mm512_set1_ps(mx[g]))));
                _mm512_storeu_ps(sg, e);
                sum[g] = _mm512_add_ps(sum[g], e);
            }
        }
        for (int g = 0; g < hg; g++) {
            part[(size_t)(g0 + g) * part_len] = mx[g];
            part[(size_t)(g0 + g) * part_len + 1] = _mm512_reduce_add_ps(sum[g]);
        }
    }
}

// out[r] = sum_j p[r][j] v_j for `rows` rows over the same n keys (probabilities at p + r *
// ATT_CHUNK, outputs at out + r * part_len; V rows at element off[j], format fmt): passes
// over the V rows for as many rows as the registers hold (the heads of one token or of several
// that read the same keys: each row's sum in the same order either way).
static inline __attribute__((always_inline)) void attend_values16(const void *v, const size_t *off, int fmt, int n,
                                                                   const float *p, int rows, int D, float *out,
                                                                   size_t part_len, att_prefetch *pf) {
    const int w = D / 16;
    const int per_pass = PV_REGS / w > PV_ROWS ? PV_ROWS : PV_REGS / w > 0 ? PV_REGS / w : 1;
    for (int r0 = 0; r0 < rows; r0 += per_pass) {
        const int hg = rows - r0 < per_pass ? rows - r0 : per_pass;
        const float *pr = p + (size_t)r0 * ATT_CHUNK;
        float *o = out + (size_t)r0 * part_len;
        if (w > PV_REGS) {  // D beyond 384: one row at a time, in parts
            for (int i0 = 0; i0 < w; i0 += PV_REGS)
                pv_pass(v, off, fmt, D, n, pr, 1, i0, w - i0 < PV_REGS ? w - i0 : PV_REGS, o, part_len, pf);
            continue;
        }
        switch (hg) {  // constant row counts: the accumulators stay in registers
            case 1: pv_pass(v, off, fmt, D, n, pr, 1, 0, w, o, part_len, pf); break;
            case 2: pv_pass(v, off, fmt, D, n, pr, 2, 0, w, o, part_len, pf); break;
            case 3: pv_pass(v, off, fmt, D, n, pr, 3, 0, w, o, part_len, pf); break;
            case 4: pv_pass(v, off, fmt, D, n, pr, 4, 0, w, o, part_len, pf); break;
            case 5: pv_pass(v, off, fmt, D, n, pr, 5, 0, w, o, part_len, pf); break;
            default: pv_pass(v, off, fmt, D, n, pr, 6, 0, w, o, part_len, pf); break;
        }
    }
}
