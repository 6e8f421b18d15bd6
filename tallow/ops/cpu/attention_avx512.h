// One chunk of paged attention on AVX-512 (included by kernels.c when compiled for it): the
// contract of attention_avx2.h's tiles (part[g] = {max, sum, out[D]} over n <= ATT_CHUNK keys)
// with 16-wide vectors, for D % 16 == 0; a token's group heads at a time.
//
// q . k for 16 keys at a time: each key's D products folded into one vector, then the 16
// vectors summed across their lanes together (hsum16x16) into one vector of 16 scores. The
// weighted sum of V runs every head of the group in one pass over the rows (a row loaded, and
// converted from float16, once for all of them). The order of every operation is fixed by n
// and D alone, so a token's result does not depend on its batch or the threads.

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

// exp8's arithmetic (kernels.c) on 16 lanes.
static inline __m512 exp16(__m512 x) {
    const __m512 hi = _mm512_set1_ps(EXP_HI), lo = _mm512_set1_ps(EXP_LO);
    const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_max_ps(_mm512_min_ps(x, hi), lo);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
    f = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), f);
    __m512 p = _mm512_set1_ps(exp_poly[0]);
    for (int i = 1; i < 6; i++) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(exp_poly[i]));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(f, f), _mm512_add_ps(f, _mm512_set1_ps(1.0f)));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps((__mmask16)~under, p, _mm512_castsi512_ps(e));
}

// 16 elements of a V row at element i (vhalf: float16).
static inline __attribute__((always_inline)) __m512 v16(const void *v, size_t i, int vhalf) {
    return vhalf ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)v + i)))
                 : _mm512_loadu_ps((const float *)v + i);
}

#define PV_REGS 16  // accumulators of the weighted V sum: up to 4 heads per pass, PV_REGS / (D / 16)

// q . k (the K row at element `at`; khalf: float16) folded to 16 lanes (w = D / 16 vectors).
static inline __attribute__((always_inline)) __m512 qk16(const float *q, const void *k, size_t at, int w, int khalf) {
    __m512 a = _mm512_mul_ps(_mm512_loadu_ps(q), v16(k, at, khalf));
    for (int i = 1; i < w; i++) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * i), v16(k, at + 16 * (size_t)i, khalf), a);
    return a;
}

// One pass of the weighted V sum for hg heads (g0 ..), the accumulators in registers:
// part[g].out[i0 * 16 ..] for wi vectors of the row. Inlined with constant hg and wi.
static inline __attribute__((always_inline)) void pv_pass(const void *v, const size_t *voff, int vhalf, int n,
                                                           const float *p, int hg, int i0, int wi, float *out,
                                                           size_t part_len) {
    __m512 acc[PV_REGS];
    for (int r = 0; r < PV_REGS; r++) acc[r] = _mm512_setzero_ps();
    for (int j = 0; j < n; j++)
        for (int i = 0; i < wi; i++) {
            const __m512 vi = v16(v, voff[j] + 16 * (size_t)(i0 + i), vhalf);
            for (int g = 0; g < hg && g * wi + i < PV_REGS; g++)  // (hg * wi <= PV_REGS: the bound is for gcc)
                acc[g * wi + i] = _mm512_fmadd_ps(_mm512_set1_ps(p[(size_t)g * ATT_CHUNK + j]), vi, acc[g * wi + i]);
        }
    for (int g = 0; g < hg; g++)
        for (int i = 0; i < wi && g * wi + i < PV_REGS; i++)
            _mm512_storeu_ps(out + g * part_len + 16 * (size_t)(i0 + i), acc[g * wi + i]);
}

// One chunk of n <= ATT_CHUNK keys for the group's heads q[g] (g < group): K and V rows at
// element off[j] of the caches (float16 where half). scores: group * ATT_CHUNK floats.
static inline __attribute__((always_inline)) void attend_chunk16(const float *q, int group, int D, float scale,
                                                                  const void *k, const void *v, const size_t *off,
                                                                  int half, int n, float *scores, float *part) {
    const size_t part_len = (size_t)D + 2;
    const int w = D / 16;
    for (int g = 0; g < group; g++) {
        const float *qg = q + (size_t)g * D;
        float *sg = scores + (size_t)g * ATT_CHUNK;
        for (int j0 = 0; j0 < n; j0 += 16) {
            __m512 a[16];
            if (j0 + 16 <= n) {  // a[r]: key j0 + perm16[r], so lane i of the sum is key j0 + i
#pragma GCC unroll 16
                for (int r = 0; r < 16; r++) a[r] = qk16(qg, k, off[j0 + perm16[r]], w, half);
            } else {
                for (int r = 0; r < 16; r++)
                    a[r] = j0 + perm16[r] < n ? qk16(qg, k, off[j0 + perm16[r]], w, half) : _mm512_setzero_ps();
            }
            _mm512_storeu_ps(sg + j0, _mm512_mul_ps(hsum16x16(a), _mm512_set1_ps(scale)));
        }
        // exp(s - max) in place, the lanes past n masked out of the max and the sum
        __m512 mv = _mm512_set1_ps(-INFINITY);
        for (int j0 = 0; j0 < n; j0 += 16) {
            const __mmask16 live = n - j0 >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j0)) - 1);
            mv = _mm512_mask_max_ps(mv, live, mv, _mm512_loadu_ps(sg + j0));
        }
        const float mx = _mm512_reduce_max_ps(mv);
        __m512 sum = _mm512_setzero_ps();
        for (int j0 = 0; j0 < n; j0 += 16) {
            const __mmask16 live = n - j0 >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j0)) - 1);
            const __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + j0), _mm512_set1_ps(mx))));
            _mm512_storeu_ps(sg + j0, e);
            sum = _mm512_add_ps(sum, e);
        }
        part[g * part_len] = mx, part[g * part_len + 1] = _mm512_reduce_add_ps(sum);
    }
    // out[g] = sum_j p[g][j] v_j, a pass over the rows for as many heads as the registers hold
    const int per_pass = PV_REGS / w > 4 ? 4 : PV_REGS / w > 0 ? PV_REGS / w : 1;
    for (int g0 = 0; g0 < group; g0 += per_pass) {
        const int hg = group - g0 < per_pass ? group - g0 : per_pass;
        const float *p = scores + (size_t)g0 * ATT_CHUNK;
        float *out = part + (size_t)g0 * part_len + 2;
        if (w > PV_REGS) {  // D beyond 256: one head at a time, the row in parts
            for (int i0 = 0; i0 < w; i0 += PV_REGS)
                pv_pass(v, off, half, n, p, 1, i0, w - i0 < PV_REGS ? w - i0 : PV_REGS, out, part_len);
            continue;
        }
        switch (hg) {  // constant head counts: the accumulators stay in registers
            case 1: pv_pass(v, off, half, n, p, 1, 0, w, out, part_len); break;
            case 2: pv_pass(v, off, half, n, p, 2, 0, w, out, part_len); break;
            case 3: pv_pass(v, off, half, n, p, 3, 0, w, out, part_len); break;
            default: pv_pass(v, off, half, n, p, 4, 0, w, out, part_len); break;
        }
    }
}
