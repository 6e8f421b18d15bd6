// One chunk of paged attention with 8-wide vectors (included by kernels.c): a work item's query
// rows (a row: one token's one head) against a chunk's n <= ATT_CHUNK keys, ATT_ROWS rows to a
// register tile, each row leaving part = {max, sum, out[D]} with out unnormalized.
//
// The chunk's keys are first transposed to float32 columns (kt[d][j]: eight keys to a
// vector), so q . k needs no sums across lanes: a row's score of key j is lane j's chain of
// D multiply-adds, d = 0 .. D-1, in order. Register tiles of rows x vectors read each K vector
// (for q . k) and each V vector (for the weighted sum) once for the tile's rows, so the chunk's
// K and V (32 KB at D = 64, more than L1 holds beside the rest) are not streamed again from
// L2 for every row. A row's arithmetic is fixed by its own n and D: the keys past its n are
// computed and then masked to -inf (exp gives 0), and its weighted sum runs over the tile's
// longest n, adding exact zeros past its own; so a token's result does not depend on the
// rows it shares a tile with, its batch or the threads.

#define ATT_ROWS 3  // rows per register tile: 3 x 4 accumulators of 8 lanes

// r[i] = column i of the 8x8 block whose row k is r[k] on entry.
static inline __attribute__((always_inline)) void transpose8x8(__m256 r[8]) {
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(u0, u4, 0x20), r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    r[2] = _mm256_permute2f128_ps(u2, u6, 0x20), r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    r[4] = _mm256_permute2f128_ps(u0, u4, 0x31), r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    r[6] = _mm256_permute2f128_ps(u2, u6, 0x31), r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// The chunk's n keys (rows at element off[j] of the cache, format fmt: KV_*) as float32
// columns: kt[d * ATT_CHUNK + j] for j < n rounded up to 8, zeros past n (an int8 row: its codes
// times their blocks' scales).
static void keys_transposed(const void *k_cache, int fmt, const size_t *off, int n, int D, float *kt) {
    for (int j0 = 0; j0 < n; j0 += 8) {
        for (int d0 = 0; d0 < D; d0 += 8) {
            __m256 r[8];
            for (int i = 0; i < 8; i++)
                r[i] = j0 + i >= n     ? _mm256_setzero_ps()
                       : fmt == KV_I8  ? _mm256_mul_ps(int8x8((const int8_t *)k_cache + off[j0 + i] + d0),
                                                       _mm256_set1_ps(kv_block_scale(k_cache, off[j0 + i], D, d0 / KV_I8_BLOCK)))
                       : fmt == KV_F16 ? half8((const uint16_t *)k_cache + off[j0 + i] + d0)
                                       : _mm256_loadu_ps((const float *)k_cache + off[j0 + i] + d0);
            transpose8x8(r);
            for (int i = 0; i < 8; i++) _mm256_storeu_ps(kt + (size_t)(d0 + i) * ATT_CHUNK + j0, r[i]);
        }
    }
}

// s[r * ATT_CHUNK + j] = scale * (q[r] . k_j) for the R rows and the keys of vectors 0 .. nv-1,
// four vectors of keys at a time, then one.
static inline __attribute__((always_inline)) void rows_qk(const float *const *q, int R, const float *kt, int D,
                                                           int nv, float scale, float *s) {
    const __m256 sv = _mm256_set1_ps(scale);
    int v = 0;
    for (; v + 4 <= nv; v += 4) {
        __m256 a[ATT_ROWS][4];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < 4; c++) a[r][c] = _mm256_setzero_ps();
        const float *k = kt + 8 * v;
#pragma GCC unroll 4
        for (int d = 0; d < D; d++, k += ATT_CHUNK) {  // 12 sums, 3 broadcasts and a K vector: 16 registers
            __m256 b[ATT_ROWS];
            for (int r = 0; r < R; r++) b[r] = _mm256_broadcast_ss(q[r] + d);
            for (int c = 0; c < 4; c++) {
                const __m256 kc = _mm256_loadu_ps(k + 8 * c);
                for (int r = 0; r < R; r++) a[r][c] = _mm256_fmadd_ps(b[r], kc, a[r][c]);
            }
        }
        for (int r = 0; r < R; r++)
            for (int c = 0; c < 4; c++) _mm256_storeu_ps(s + r * ATT_CHUNK + 8 * (v + c), _mm256_mul_ps(a[r][c], sv));
    }
    for (; v < nv; v++) {
        __m256 a[ATT_ROWS];
        for (int r = 0; r < R; r++) a[r] = _mm256_setzero_ps();
        const float *k = kt + 8 * v;
        for (int d = 0; d < D; d++, k += ATT_CHUNK) {
            const __m256 k0 = _mm256_loadu_ps(k);
            for (int r = 0; r < R; r++) a[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(q[r] + d), k0, a[r]);
        }
        for (int r = 0; r < R; r++) _mm256_storeu_ps(s + r * ATT_CHUNK + 8 * v, _mm256_mul_ps(a[r], sv));
    }
}

// A row's n scores (s[0 .. 8 * nv), nv >= ceil(n / 8)) to exp(s - max) in place, zeros past n;
// part[0] = max, part[1] = the sum of the exps (one 8-lane sum over its own vectors, then
// across the lanes).
static inline void row_softmax(float *s, int n, int nv, float *part) {
    const int own = (n + 7) / 8;
    for (int j = n; j < 8 * own; j++) s[j] = -INFINITY;
    const float mx = max_of(s, n);
    const __m256 mv = _mm256_set1_ps(mx);
    __m256 sum = _mm256_setzero_ps();
    for (int v = 0; v < own; v++) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + 8 * v), mv));
        _mm256_storeu_ps(s + 8 * v, e);
        sum = _mm256_add_ps(sum, e);
    }
    for (int v = own; v < nv; v++) _mm256_storeu_ps(s + 8 * v, _mm256_setzero_ps());
    part[0] = mx, part[1] = hsum8(sum);
}

// out[r][0 .. D) = sum_j p[r * ATT_CHUNK + j] v_j over j < nj in order (V rows at element
// voff[j] of v, float32), four vectors of the row at a time, then one.
static inline __attribute__((always_inline)) void rows_pv(const float *p, int R, const float *v, const size_t *voff,
                                                           int nj, int D, float *const *out) {
    int d0 = 0;
    for (; d0 + 32 <= D; d0 += 32) {
        __m256 a[ATT_ROWS][4];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < 4; c++) a[r][c] = _mm256_setzero_ps();
        for (int j = 0; j < nj; j++) {  // as rows_qk's: 16 registers
            const float *vr = v + voff[j] + d0;
            __m256 b[ATT_ROWS];
            for (int r = 0; r < R; r++) b[r] = _mm256_broadcast_ss(p + r * ATT_CHUNK + j);
            for (int c = 0; c < 4; c++) {
                const __m256 vc = _mm256_loadu_ps(vr + 8 * c);
                for (int r = 0; r < R; r++) a[r][c] = _mm256_fmadd_ps(b[r], vc, a[r][c]);
            }
        }
        for (int r = 0; r < R; r++)
            for (int c = 0; c < 4; c++) _mm256_storeu_ps(out[r] + d0 + 8 * c, a[r][c]);
    }
    for (; d0 < D; d0 += 8) {
        __m256 a[ATT_ROWS];
        for (int r = 0; r < R; r++) a[r] = _mm256_setzero_ps();
        for (int j = 0; j < nj; j++) {
            const __m256 v0 = _mm256_loadu_ps(v + voff[j] + d0);
            for (int r = 0; r < R; r++) a[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + r * ATT_CHUNK + j), v0, a[r]);
        }
        for (int r = 0; r < R; r++) _mm256_storeu_ps(out[r] + d0, a[r]);
    }
}

// A row of a work item: its query, its result part and its n >= 1 keys of the chunk.
typedef struct {
    const float *q;
    float *part;
    int n;
} att_row;

// The tile of rows from i0 (ATT_ROWS of them, fewer at the end): returns its row count; *nj
// its longest key count, q[] and out[] its queries and output vectors.
static inline int att_tile(const att_row *rows, int nrows, int i0, int *nj, const float **q, float **out) {
    const int R = nrows - i0 < ATT_ROWS ? nrows - i0 : ATT_ROWS;
    *nj = 0;
    for (int r = 0; r < R; r++) {
        q[r] = rows[i0 + r].q, out[r] = rows[i0 + r].part + 2;
        *nj = rows[i0 + r].n > *nj ? rows[i0 + r].n : *nj;
    }
    return R;
}

// A work item's rows against the chunk: kt its keys (keys_transposed), V rows at voff[j] of v
// (float32). In tiles of ATT_ROWS consecutive rows, in three passes: q.k of every tile (the
// chunk's K columns stay in L1 for all of them), the rows' softmax, then every tile's p.v (V
// in L1). scores: nrows * ATT_CHUNK floats.
static inline __attribute__((always_inline)) void attend_rows(const att_row *rows, int nrows, int D, float scale,
                                                               const float *kt, const float *v, const size_t *voff,
                                                               float *scores) {
    const float *q[ATT_ROWS];
    float *out[ATT_ROWS];
    int nj;
    for (int i0 = 0; i0 < nrows; i0 += ATT_ROWS) {
        const int R = att_tile(rows, nrows, i0, &nj, q, out);
        const int nv = (nj + 7) / 8;
        float *s = scores + (size_t)i0 * ATT_CHUNK;
        switch (R) {  // constant row counts: the accumulators stay in registers
            case 1: rows_qk(q, 1, kt, D, nv, scale, s); break;
            case 2: rows_qk(q, 2, kt, D, nv, scale, s); break;
            default: rows_qk(q, 3, kt, D, nv, scale, s); break;
        }
        for (int r = 0; r < R; r++) row_softmax(s + r * ATT_CHUNK, rows[i0 + r].n, nv, rows[i0 + r].part);
    }
    for (int i0 = 0; i0 < nrows; i0 += ATT_ROWS) {
        const int R = att_tile(rows, nrows, i0, &nj, q, out);
        const float *s = scores + (size_t)i0 * ATT_CHUNK;
        switch (R) {
            case 1: rows_pv(s, 1, v, voff, nj, D, out); break;
            case 2: rows_pv(s, 2, v, voff, nj, D, out); break;
            default: rows_pv(s, 3, v, voff, nj, D, out); break;
        }
    }
}

// attend_rows compiled with the common head sizes as constants, else any D % 8 == 0.
static void attend_item(const att_row *rows, int nrows, int D, float scale, const float *kt, const float *v,
                        const size_t *voff, float *scores) {
    if (D == 64)
        attend_rows(rows, nrows, 64, scale, kt, v, voff, scores);
    else if (D == 128)
        attend_rows(rows, nrows, 128, scale, kt, v, voff, scores);
    else
        attend_rows(rows, nrows, D, scale, kt, v, voff, scores);
}
