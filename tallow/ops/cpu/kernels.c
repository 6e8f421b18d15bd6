// tallow's CPU kernels (AVX2 + FMA; the linear layers also on AVX-512 VNNI, or on AVX2 with
// AVX-VNNI's multiply-adds: TL_VNNI256 below), loaded through ctypes by tallow/ops/cpu_native.py,
// which compiles this file once per instruction set. "Both builds" below means the AVX-512 code
// and the AVX2 code, which the avx2 and avxvnni builds share.
//
// (Many rows run on AMX tiles where the CPU has them: linear_amx.h, linear_gguf_amx.h.)
//
// Linear layers over block-quantized weights: the activations are quantized per block of 32
// to integers held in int16, each block's integer dot product with the weights is exact (madd,
// vpdpwssd or AMX tile products), and is scaled into a float32 accumulator. Q8 layers take
// 16-bit integers (scale = max|x| / 32767: 2^-16 of the block's largest value, finer than
// bfloat16); Q4 layers 12-bit ones (max|x| / 2047), so that on AMX a block is one tile
// product: x = 16 h + l (h a signed byte, l in 0..15) against Q4's codes q and 16 q (both
// bytes) in one 64-byte row, where 16-bit needs two products and two stores (linear_amx.h).
// On SmolLM2 (the default, Q4_1 with a Q8_0 LM head) as the engine runs it, 12-bit moved the
// logits of 400 positions by at most 0.43% of the largest against transformers' float32 model of
// the same file (16-bit: 0.083%; llama.cpp's int8 q8_1 arithmetic: about 7%), and 15 of 16
// greedy answers of 160 tokens were those of 16-bit (int8: 5 of 16, the first differing after 6
// tokens): benchmarks/cpu_accuracy.py, HISTORY's stop 41. GGUF's 5-bit and K-quant
// formats (linear_gguf.h) take int8 activations (quantize_rows8): byte products at twice the
// rate, as llama.cpp computes those formats.
//   Q4: w = d * q + m, q in 0..15 (GGUF's Q4_1).
//   Q8: w = d * q, q in -127..127 (GGUF's Q8_0).
// d and m are float16 (as in GGUF), one per (output channel, block). The weights are stored
// in tiles of NT = 16 output channels, one layout for both builds (linear_avx512.h describes
// it; linear_avx2.h reads it 8 channels to a register), and both compute the same floats;
// tl_tile_channels() tells the Python side the tile.
//
// Every output (row, column) is computed by the same arithmetic whatever the number of rows
// and threads: threads split the tiles of columns, never a dot product. So a row's result
// does not depend on what it is batched with (greedy batching invariance).

#define _GNU_SOURCE  // syscall() (linear_amx.h asks for the tile state)
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define QK 32

int tl_abi_version(void) { return 14; }

static inline float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

// 8 float16 values as float32 (F16C); 8 int8 values as float32.
static inline __m256 half8(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline __m256 int8x8(const int8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))); }

// The int16 pair (x[0], x[1]) in every 32-bit lane: the activation operand of madd against
// weight vectors with one channel per lane (linear_avx2.h, linear_gguf.h's AVX2 loops).
static inline __m256i pair_bcast(const int16_t *x) {
    typedef int32_t __attribute__((may_alias)) pair;
    return _mm256_set1_epi32(*(const pair *)x);
}

// AVX-VNNI (Intel's client cores from Alder Lake, Zen 5): the AVX2 build compiled with it
// (the "avxvnni" variant) multiplies and adds in one instruction where AVX2 takes two or three:
// vpdpwssd = madd + add (int16 pairs), vpdpbusd = maddubs + madd by ones + add (byte quads),
// exact in int32 and never saturating, so the integers are those of the AVX2 loops (which
// never saturate either: linear_gguf.h's groups) and the two builds compute the same floats.
// TL_VNNI256_EVEX runs the same code with the EVEX encodings of AVX-512 VNNI / VL, for testing
// on CPUs that have those but not AVX-VNNI (tests/test_cpu_avxvnni.py); it is never served.
// dpwssd256(acc, a, b): acc + each 32-bit lane's two int16 products; dpbusd256(acc, u, s): acc +
// each lane's four products of unsigned bytes u and signed bytes s.
#if !defined(__AVX512F__) && defined(__AVXVNNI__)
#define TL_VNNI256 1
#define dpwssd256 _mm256_dpwssd_avx_epi32
#define dpbusd256 _mm256_dpbusd_avx_epi32
#elif !defined(__AVX512F__) && defined(TL_VNNI256_EVEX)
#define TL_VNNI256 1
#define VNNI256_EVEX(name, insn)                                                                          \
    static inline __attribute__((always_inline)) __m256i name(__m256i acc, __m256i a, __m256i b) {       \
        __asm__("%{evex%} " insn " %[b], %[a], %[acc]" : [acc] "+x"(acc) : [a] "x"(a), [b] "x"(b)); \
        return acc;                                                                                      \
    }
VNNI256_EVEX(dpwssd256, "vpdpwssd")
VNNI256_EVEX(dpbusd256, "vpdpbusd")
#else
#define TL_VNNI256 0
#endif

// A block of 32 floats as integers of scale d = max|x| / levels: v[0..3] (loaded from xb) become
// round(x * levels / max|x|) (to nearest even; all 0 for a block of zeros); returns d.
static inline __attribute__((always_inline)) float block_round(const float *xb, float levels, __m256 v[4]) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(xb + 8 * i);
    __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                             _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const float db = amax / levels;
    const __m256 id = _mm256_set1_ps(db > 0.0f ? levels / amax : 0.0f);
    for (int i = 0; i < 4; i++)
        v[i] = _mm256_round_ps(_mm256_mul_ps(v[i], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return db;
}

// The integers Q4 and Q8 layers' activations are rounded to: |q| <= levels (above).
#define Q4_LEVELS 2047.0f
#define Q8_LEVELS 32767.0f

// One row of K floats (K % 32 == 0) to integer blocks held in int16 (|q| <= levels): q[K],
// d[K/32] (the scale, max|x| / levels) and s[K/32] (d * the block's integer sum, for Q4's m term).
static void quantize_row_q16(const float *x, int K, int16_t *q, float *d, float *s, float levels) {
    for (int b = 0; b < K / QK; b++) {
        __m256 v[4];
        const float db = block_round(x + b * QK, levels, v);
        const __m256 v0 = v[0], v1 = v[1], v2 = v[2], v3 = v[3];
        d[b] = db;
        s[b] = db * hsum8(_mm256_add_ps(_mm256_add_ps(v0, v1), _mm256_add_ps(v2, v3)));  // exact integer sum
        // packs works within 128-bit lanes: [a0-3 b0-3 | a4-7 b4-7] -> 64-bit permute restores the order.
        const __m256i i0 = _mm256_permute4x64_epi64(_mm256_packs_epi32(_mm256_cvtps_epi32(v0), _mm256_cvtps_epi32(v1)), 0xD8);
        const __m256i i1 = _mm256_permute4x64_epi64(_mm256_packs_epi32(_mm256_cvtps_epi32(v2), _mm256_cvtps_epi32(v3)), 0xD8);
        _mm256_storeu_si256((__m256i *)(q + b * QK), i0);
        _mm256_storeu_si256((__m256i *)(q + b * QK + 16), i1);
    }
}

// Work items 0 .. n - 1 of a parallel region, handed out so that a late thread does not hold up
// the others at its end: thread i owns the i-th of nthreads contiguous ranges and takes its items
// from the front, in order (its weights stream as under a static schedule), a quarter of what
// is left there at a time; a thread whose range is empty takes the last items of the others',
// one at a time (a thread the host delays, or whose core the server's event loop takes for a
// while, gives its tail away). Who runs an item changes no bit of its result. Each range (front
// in the low 32 bits, end in the high) has a cache line of its own. (A claim is a locked
// instruction, which waits for the memory operations before it: with a claim a tile, 4% of a
// 32-sequence step's samples sat on it; fewer claims moved most of those waits to the
// weights' prefetches, for about 1% of the step.)
typedef struct {
    _Alignas(64) uint64_t range;
} work_range;

static work_range *work_ranges(int nthreads, int n) {
    work_range *w = (work_range *)aligned_alloc(64, sizeof(work_range) * (size_t)nthreads);
    if (w)
        for (int i = 0; i < nthreads; i++)
            w[i].range = (uint64_t)n * i / nthreads | (uint64_t)n * (i + 1) / nthreads << 32;
    return w;
}

// Items *lo .. *hi - 1 for thread `me` (from its own range's front, else another range's last);
// returns 0 when there are none.
static inline int work_claim(work_range *w, int nthreads, int me, int *lo, int *hi) {
    for (int k = 0; k < nthreads; k++) {
        work_range *o = &w[(me + k) % nthreads];
        uint64_t r = __atomic_load_n(&o->range, __ATOMIC_RELAXED);
        while ((uint32_t)r < (uint32_t)(r >> 32)) {
            const uint32_t left = (uint32_t)(r >> 32) - (uint32_t)r, take = k || left < 8 ? 1 : left / 4;
            const uint64_t want = k ? r - ((uint64_t)1 << 32) : r + take;
            if (__atomic_compare_exchange_n(&o->range, &r, want, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
                *lo = k ? (int)(uint32_t)(want >> 32) : (int)(uint32_t)r;
                *hi = *lo + (int)(k ? 1 : take);
                return 1;
            }
        }
    }
    return 0;
}

// A layer's weight tiles go out by work_claim from this many rows (a tile is then worth a claim);
// with fewer, each thread takes a static share.
#define STEAL_MIN_ROWS 9

// A thread's walk over a region's weight tiles: its static share of them where work is NULL,
// else work_claim's claims; tiles next .. end - 1 are its own.
typedef struct {
    work_range *work;
    int nthreads, me, next, end;
} tile_walk;

static inline tile_walk tile_walk_start(work_range *work, int nthreads, int tiles) {
    const int me = omp_get_thread_num(), team = omp_get_num_threads();
    if (work) return (tile_walk){work, nthreads, me, 0, 0};
    return (tile_walk){NULL, nthreads, me, (int)((long)tiles * me / team), (int)((long)tiles * (me + 1) / team)};
}

// The thread's next tile, or -1 when there is none.
static inline int next_tile(tile_walk *w) {
    if (w->next < w->end || (w->work && work_claim(w->work, w->nthreads, w->me, &w->next, &w->end))) return w->next++;
    return -1;
}

// Activations quantized once per call, rows in parallel.
typedef struct {
    int16_t *q;
    float *d, *s;
} qrows;

static int quantize_rows(const float *x, int M, int K, int nthreads, int q8, qrows *out) {
    const float levels = q8 ? Q8_LEVELS : Q4_LEVELS;
    const int nb = K / QK;
    out->q = (int16_t *)aligned_alloc(32, sizeof(int16_t) * ((size_t)M * K + 16));
    out->d = (float *)malloc(sizeof(float) * (size_t)M * nb);
    out->s = (float *)malloc(sizeof(float) * (size_t)M * nb);
    if (!out->q || !out->d || !out->s) {
        free(out->q), free(out->d), free(out->s);
        return -1;
    }
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M > 8)
    for (int m = 0; m < M; m++)
        quantize_row_q16(x + (size_t)m * K, K, out->q + (size_t)m * K, out->d + (size_t)m * nb, out->s + (size_t)m * nb, levels);
    return 0;
}

static void free_rows(qrows *r) { free(r->q), free(r->d), free(r->s); }

// One row of K floats (K % 32 == 0) to int8 blocks (linear_gguf.h's formats): block b's 32
// values at q + b * bs (round(x * 127 / max|x|), |q| <= 127), d[b] = max|x| / 127, s[b] = d[b] *
// the block's integer sum, hs[2 b + h] = the integer sum of its half h (16 values).
// A block_round block's 32 integers (|q| <= 127) as bytes at dst, in order.
static inline __attribute__((always_inline)) void store_block_i8(const __m256 v[4], int8_t *dst) {
    // packs work within 128-bit lanes: [v0 0-3, v1 0-3, v2 0-3, v3 0-3 | the 4-7s]; the dword
    // permute restores the order.
    const __m256i w01 = _mm256_packs_epi32(_mm256_cvtps_epi32(v[0]), _mm256_cvtps_epi32(v[1]));
    const __m256i w23 = _mm256_packs_epi32(_mm256_cvtps_epi32(v[2]), _mm256_cvtps_epi32(v[3]));
    _mm256_storeu_si256((__m256i *)dst, _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23),
                                                                    _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

static void quantize_row_q8(const float *x, int K, int8_t *q, size_t bs, float *d, float *s, int16_t *hs) {
    for (int b = 0; b < K / QK; b++) {
        __m256 v[4];
        const float db = block_round(x + b * QK, 127.0f, v);
        const __m256 v0 = v[0], v1 = v[1], v2 = v[2], v3 = v[3];
        const float h0 = hsum8(_mm256_add_ps(v0, v1)), h1 = hsum8(_mm256_add_ps(v2, v3));  // exact integers
        d[b] = db;
        s[b] = db * (h0 + h1);
        hs[2 * b] = (int16_t)h0, hs[2 * b + 1] = (int16_t)h1;
        store_block_i8(v, q + b * bs);
    }
}

// int8 activations (quantize_row_q8) of M rows, laid out as qrows.
typedef struct {
    int8_t *q;
    float *d, *s;
    int16_t *hs;
    size_t rs, bs;
} qrows8;

static inline const int8_t *q8block(const qrows8 *r, size_t row, int b) { return r->q + row * r->rs + b * r->bs; }

static int quantize_rows8(const float *x, int M, int K, int nthreads, int block_major, qrows8 *out) {
    const int nb = K / QK;
    out->rs = block_major ? QK : (size_t)K;
    out->bs = block_major ? (size_t)QK * M : QK;
    out->q = (int8_t *)aligned_alloc(32, (size_t)M * K + 64);
    out->d = (float *)malloc(sizeof(float) * (size_t)M * nb);
    out->s = (float *)malloc(sizeof(float) * (size_t)M * nb);
    out->hs = (int16_t *)malloc(sizeof(int16_t) * 2 * (size_t)M * nb);
    if (!out->q || !out->d || !out->s || !out->hs) {
        free(out->q), free(out->d), free(out->s), free(out->hs);
        return -1;
    }
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M > 8)
    for (int m = 0; m < M; m++)
        quantize_row_q8(x + (size_t)m * K, K, out->q + (size_t)m * out->rs, out->bs, out->d + (size_t)m * nb,
                        out->s + (size_t)m * nb, out->hs + (size_t)2 * m * nb);
    return 0;
}

static void free_rows8(qrows8 *r) { free(r->q), free(r->d), free(r->s), free(r->hs); }

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include "linear_avx512.h"  // with linear_amx.h
#define TL_AMX 1
#else
#include "linear_avx2.h"
int tl_amx_enable(void) { return 0; }  // the AVX2 build has no tile kernel
int tl_amx_set(int on) { (void)on; return 0; }
#endif
#include "linear_gguf.h"  // GGUF's Q5_0, Q5_1, Q4_K, Q5_K, Q6_K blocks (both builds; with linear_gguf_amx.h)

// The output channels of one weight tile: the layout the Python side packs (quant.py).
int tl_tile_channels(void) { return NT; }

int tl_q4_linear(const float *x, int M, int K, int N, const uint8_t *wq, const uint16_t *wd, const uint16_t *wm,
                 const float *bias, float *y, int nthreads) {
    return linear(x, M, K, N, wq, wd, wm, bias, y, nthreads, 0);
}

int tl_q8_linear(const float *x, int M, int K, int N, const int8_t *wq, const uint16_t *wd, const uint16_t *unused_wm,
                 const float *bias, float *y, int nthreads) {
    (void)unused_wm;  // the same signature as tl_q4_linear
    return linear(x, M, K, N, (const uint8_t *)wq, wd, NULL, bias, y, nthreads, 1);
}

// ---- elementwise ops, float32 ------------------------------------------------------------

// exp(x): 2^n * p(f) with n = round(x / ln 2), f = x - n ln 2 (two-part ln 2), p a degree-6
// polynomial (Cephes expf); relative error ~2e-7. Below -87.3 gives 0. The constants, shared by
// exp8 and the AVX-512 exp16:
#define EXP_HI 88.3762626647949f
#define EXP_LO -87.3365447504f
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO -2.12194440e-4f
static const float exp_poly[6] = {1.9875691500E-4f, 1.3981999507E-3f, 8.3334519073E-3f,
                                  4.1665795894E-2f, 1.6666665459E-1f, 5.0000001201E-1f};

static inline __m256 exp8(__m256 x) {
    const __m256 hi = _mm256_set1_ps(EXP_HI), lo = _mm256_set1_ps(EXP_LO);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(_mm256_min_ps(x, hi), lo);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
    f = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), f);
    __m256 p = _mm256_set1_ps(exp_poly[0]);
    for (int i = 1; i < 6; i++) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(exp_poly[i]));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(f, f), _mm256_add_ps(f, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

#if defined(__AVX512F__)
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
#endif

void tl_exp(const float *x, float *y, int n) {  // for tests of exp8
    for (int i = 0; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, exp8(_mm256_loadu_ps(x + i)));
}

// Each of N rows of V floats (rows `stride` floats apart): its largest value and the index of
// that value's first place, or, in a row holding a NaN, NaN and the first NaN's place: what
// torch.max(dim=-1) gives on the CPU (the greedy pick of a batch's logits). Rows in parallel.
void tl_rows_max(const float *x, long N, long V, long stride, float *val, int64_t *idx, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (N > 1 && V >= 4096)
    for (long r = 0; r < N; r++) {
        const float *row = x + r * stride;
        __m256 best = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
        __m256i at = _mm256_setzero_si256();  // per lane: the first index of its best
        __m256i j8 = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256i eight = _mm256_set1_epi32(8);
        long j = 0;
        for (; j + 8 <= V; j += 8, j8 = _mm256_add_epi32(j8, eight)) {
            const __m256 v = _mm256_loadu_ps(row + j);
            const __m256 gt = _mm256_cmp_ps(v, best, _CMP_GT_OQ);  // strictly: a lane keeps its first
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            best = _mm256_blendv_ps(best, v, gt);
            at = _mm256_blendv_epi8(at, j8, _mm256_castps_si256(gt));
        }
        long k = 0;
        if (_mm256_movemask_ps(nan)) {  // the first NaN
            while (row[k] == row[k]) k++;
        } else {
            float m = row[0];  // V < 8: no vector pass, the tail is the row
            if (j) {  // the lanes' bests, the first place among equals
                float b[8];
                int32_t a[8];
                _mm256_storeu_ps(b, best);
                _mm256_storeu_si256((__m256i *)a, at);
                m = b[0], k = a[0];
                for (int l = 1; l < 8; l++)
                    if (b[l] > m || (b[l] == m && a[l] < k)) m = b[l], k = a[l];
            }
            for (; j < V; j++) {  // the tail, past every vector's places
                if (row[j] != row[j]) {
                    k = j;
                    break;
                }
                if (row[j] > m) m = row[j], k = j;
            }
        }
        val[r] = row[k], idx[r] = k;
    }
}

// residual_out = x + residual (residual NULL: x itself); out = residual_out / rms * weight.
// Rows of D (D % 8 == 0), contiguous.
void tl_add_rms_norm(const float *x, const float *residual, const float *weight, float eps, int T, int D,
                     float *out, float *residual_out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T > 16)
    for (int t = 0; t < T; t++) {
        const float *xr = x + (size_t)t * D;
        float *rr = residual_out + (size_t)t * D;
        __m256 ss = _mm256_setzero_ps();
        for (int i = 0; i < D; i += 8) {
            __m256 v = _mm256_loadu_ps(xr + i);
            if (residual) v = _mm256_add_ps(v, _mm256_loadu_ps(residual + (size_t)t * D + i));
            if (residual_out != x) _mm256_storeu_ps(rr + i, v);
            ss = _mm256_fmadd_ps(v, v, ss);
        }
        const __m256 r = _mm256_set1_ps(1.0f / sqrtf(hsum8(ss) / (float)D + eps));
        const float *src = residual_out == x ? xr : rr;
        for (int i = 0; i < D; i += 8)
            _mm256_storeu_ps(out + (size_t)t * D + i,
                             _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(src + i), r), _mm256_loadu_ps(weight + i)));
    }
}

// out[t, :I] = silu(x[t, :I]) * x[t, I:2I]; I % 8 == 0.
void tl_silu_and_mul(const float *x, int T, int I, float *out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T > 16)
    for (int t = 0; t < T; t++) {
        const float *g = x + (size_t)t * 2 * I, *u = g + I;
        float *o = out + (size_t)t * I;
        int i = 0;
#if defined(__AVX512F__)  // the same arithmetic 16 lanes at a time (exp16 is exp8's)
        for (; i + 16 <= I; i += 16) {
            const __m512 a = _mm512_loadu_ps(g + i);
            const __m512 s = _mm512_div_ps(a, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), a))));
            _mm512_storeu_ps(o + i, _mm512_mul_ps(s, _mm512_loadu_ps(u + i)));
        }
#endif
        for (; i < I; i += 8) {
            __m256 a = _mm256_loadu_ps(g + i);
            __m256 s = _mm256_div_ps(a, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), a))));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
        }
    }
}

// out[t, :I] = gelu_tanh(x[t, :I]) * x[t, I:2I]; I % 8 == 0 (Gemma's GeGLU). gelu_tanh(a) =
// 0.5 a (1 + tanh(u)) = a / (1 + exp(-2u)), u = sqrt(2 / pi) (a + 0.044715 a^3): the sigmoid
// form of tl_silu_and_mul, no cancellation near 0.
void tl_gelu_tanh_and_mul(const float *x, int T, int I, float *out, int nthreads) {
    const __m256 k0 = _mm256_set1_ps(-2.0f * 0.7978845608028654f), k1 = _mm256_set1_ps(0.044715f);
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T > 16)
    for (int t = 0; t < T; t++) {
        const float *g = x + (size_t)t * 2 * I, *u = g + I;
        float *o = out + (size_t)t * I;
        for (int i = 0; i < I; i += 8) {
            const __m256 a = _mm256_loadu_ps(g + i);
            const __m256 inner = _mm256_fmadd_ps(_mm256_mul_ps(k1, a), _mm256_mul_ps(a, a), a);  // a + 0.044715 a^3
            const __m256 e = exp8(_mm256_mul_ps(k0, inner));
            const __m256 gelu = _mm256_div_ps(a, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(gelu, _mm256_loadu_ps(u + i)));
        }
    }
}

// RMSNorm over each head of x [T, heads, D] in place (rows at row_stride floats, heads contiguous
// at stride D; D % 8 == 0): Qwen3's and Gemma 3's q/k norms, each head's arithmetic that of
// tl_add_rms_norm on a row of D without a residual.
void tl_head_rms_norm(float *x, int T, int heads, int D, long row_stride, const float *weight, float eps,
                      int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T * heads > 64)
    for (int th = 0; th < T * heads; th++) {
        float *xr = x + (size_t)(th / heads) * row_stride + (size_t)(th % heads) * D;
        __m256 ss = _mm256_setzero_ps();
        for (int i = 0; i < D; i += 8) {
            const __m256 v = _mm256_loadu_ps(xr + i);
            ss = _mm256_fmadd_ps(v, v, ss);
        }
        const __m256 r = _mm256_set1_ps(1.0f / sqrtf(hsum8(ss) / (float)D + eps));
        for (int i = 0; i < D; i += 8)
            _mm256_storeu_ps(xr + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), r), _mm256_loadu_ps(weight + i)));
    }
}

// Neox rotary embedding in place on x [T, heads, D] (row stride in floats; heads contiguous
// at stride D): x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin, (cos, sin) = cos_sin[pos] halves.
void tl_rotary(float *x, int T, int heads, int D, long row_stride, const int64_t *positions,
               const float *cos_sin, int nthreads) {
    const int half = D / 2;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T > 16)
    for (int t = 0; t < T; t++) {
        const float *c = cos_sin + positions[t] * D, *s = c + half;
        for (int h = 0; h < heads; h++) {
            float *x1 = x + t * row_stride + (size_t)h * D, *x2 = x1 + half;
            int i = 0;
            for (; i + 8 <= half; i += 8) {
                __m256 a = _mm256_loadu_ps(x1 + i), b = _mm256_loadu_ps(x2 + i);
                __m256 cv = _mm256_loadu_ps(c + i), sv = _mm256_loadu_ps(s + i);
                _mm256_storeu_ps(x1 + i, _mm256_fmsub_ps(a, cv, _mm256_mul_ps(b, sv)));
                _mm256_storeu_ps(x2 + i, _mm256_fmadd_ps(b, cv, _mm256_mul_ps(a, sv)));
            }
            for (; i < half; i++) {
                float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
    }
}

// ---- paged attention: float32 queries, a float32, float16 or int8 KV cache ---------------------

// The caches' formats (tl_kv_write's and tl_paged_attention's `fmt`). KV_I8: each (token, KV head)
// row is D int8 codes, then a float32 scale (4 bytes) per block of KV_I8_BLOCK codes: a block's
// codes are q = round(x * 127 / max|x|) (nearest even) and its scale max|x| / 127, so x ~ q *
// scale (llama.cpp's q8_0 blocks, with float32 scales). A row is D + D / 8 bytes (D % 32 == 0),
// the cache [blocks, block_size, kv_heads, D + D / 8] int8.
enum { KV_F32 = 0, KV_F16 = 1, KV_I8 = 2 };
#define KV_I8_BLOCK QK  // block_round's blocks
// elements from one (token, head) row of a cache to the next, and bytes an element
static inline size_t kv_pitch(int D, int fmt) { return fmt == KV_I8 ? (size_t)D + (size_t)D / KV_I8_BLOCK * 4 : (size_t)D; }
static inline size_t kv_esize(int fmt) { return fmt == KV_I8 ? 1 : fmt == KV_F16 ? 2 : 4; }
// the scale of block b of the int8 row at element (byte) off
static inline float kv_block_scale(const void *cache, size_t off, int D, int b) {
    float sc;
    memcpy(&sc, (const int8_t *)cache + off + D + 4 * (size_t)b, sizeof sc);
    return sc;
}

// n floats to float16, rounded to nearest even (n % 8 == 0).
static void to_half(const float *x, uint16_t *h, size_t n) {
    for (size_t i = 0; i < n; i += 8)
        _mm_storeu_si128((__m128i *)(h + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
}

// D floats (D % KV_I8_BLOCK == 0) to an int8 row: its blocks' codes, then their scales (KV_I8),
// rounded as int8 activations are (block_round).
static void to_int8_row(const float *x, int D, int8_t *dst) {
    for (int b = 0; b < D / KV_I8_BLOCK; b++) {
        __m256 v[4];
        const float scale = block_round(x + b * KV_I8_BLOCK, 127.0f, v);
        store_block_i8(v, dst + b * KV_I8_BLOCK);
        memcpy(dst + D + 4 * b, &scale, sizeof scale);
    }
}

// k/v [T, kv_heads, D] (row strides in floats) into the caches [blocks, block_size, kv_heads,
// kv_pitch] at slot_mapping[t] (negative: padding, skipped), in format fmt (KV_*: float16 rounded
// to nearest even; int8 as to_int8_row).
void tl_kv_write(const float *k, long k_stride, const float *v, long v_stride, int T, int kv_heads, int D,
                 const int64_t *slot_mapping, void *k_cache, void *v_cache, int fmt) {
    const size_t P = kv_pitch(D, fmt), n = (size_t)kv_heads * P;  // a slot's elements
    // (a prompt's or a batch's rows in parallel, on the threads torch uses: each row's store is a
    // miss to memory, about 10 us a layer for 32 rows on one thread)
#pragma omp parallel for schedule(static) if (T > 16)
    for (int t = 0; t < T; t++) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        if (fmt == KV_I8) {
            for (int h = 0; h < kv_heads; h++) {
                to_int8_row(k + t * k_stride + (size_t)h * D, D, (int8_t *)k_cache + slot * n + h * P);
                to_int8_row(v + t * v_stride + (size_t)h * D, D, (int8_t *)v_cache + slot * n + h * P);
            }
        } else if (fmt == KV_F16) {
            to_half(k + t * k_stride, (uint16_t *)k_cache + slot * n, n);
            to_half(v + t * v_stride, (uint16_t *)v_cache + slot * n, n);
        } else {
            memcpy((float *)k_cache + slot * n, k + t * k_stride, n * sizeof(float));
            memcpy((float *)v_cache + slot * n, v + t * v_stride, n * sizeof(float));
        }
    }
}

// n float16 or int8 rows of D (at element off[j] of the cache, format fmt) as float32 rows at
// dst + j * D (D % 8 == 0); an int8 row's codes times their blocks' scales.
static void gather_rows(const void *cache, int fmt, const size_t *off, int n, int D, float *dst) {
    for (int j = 0; j < n; j++)
        if (fmt == KV_I8) {
            for (int i = 0; i < D; i += 8)
                _mm256_storeu_ps(dst + (size_t)j * D + i,
                                 _mm256_mul_ps(int8x8((const int8_t *)cache + off[j] + i),
                                               _mm256_set1_ps(kv_block_scale(cache, off[j], D, i / KV_I8_BLOCK))));
        } else {
            for (int i = 0; i < D; i += 8)
                _mm256_storeu_ps(dst + (size_t)j * D + i, half8((const uint16_t *)cache + off[j] + i));
        }
}

// Attention works on chunks of ATT_CHUNK context keys: one work item is (query block, KV head,
// span of chunks); the block's tokens' query heads sharing the KV head read each chunk's K and V
// rows from memory once (attention_avx2.h, attention_avx512.h). A chunk leaves per head its max
// score, its sum of exp(score - max) and its unnormalized output; they are merged in order.
// The chunks are fixed by the token's context length alone, so the arithmetic of a token does
// not depend on the batch or the threads, and one decode token still spreads over the threads.
#define ATT_CHUNK 64

// The largest of x[0..n), n >= 1, eight at a time (a scalar loop was 5% of a long prompt's
// attention); exact in any order.
static inline float max_of(const float *x, int n) {
    __m256 m8 = _mm256_set1_ps(x[0]);
    int j = 0;
    for (; j + 8 <= n; j += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(x + j));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    float mx = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    for (; j < n; j++) mx = x[j] > mx ? x[j] : mx;
    return mx;
}

// A thread's queue of K/V rows to prefetch to L2 a few lines at a time from inside the AVX-512
// attention loops (pf_drain; NULL: none), so that fetching the rows of the work a thread takes
// next overlaps the arithmetic of the work it is doing. Prefetching a chunk's rows in one burst
// (hundreds of lines) stalls the core until line fill buffers free up, with the arithmetic queued
// behind: memory time and compute time added up.
typedef struct {
    const char **row;  // the rows' first bytes
    int n, next;  // rows queued; the row whose lines go next
    size_t len, line;  // bytes a row; the next line's offset in row `next`
} att_prefetch;

static inline __attribute__((always_inline)) void pf_drain(att_prefetch *pf, int lines) {
    if (!pf) return;
    for (int r = 0; r < lines && pf->next < pf->n; r++) {
        _mm_prefetch(pf->row[pf->next] + pf->line, _MM_HINT_T1);
        if ((pf->line += 64) >= pf->len) pf->line = 0, pf->next++;
    }
}

static void pf_flush(att_prefetch *pf) {
    while (pf->next < pf->n) pf_drain(pf, 64);
    pf->n = pf->next = 0, pf->line = 0;
}

#include "attention_avx2.h"

#if defined(__AVX512F__)
#include "attention_avx512.h"
#define ATTEND16 1  // qk_rows, softmax_rows and attend_values16 serve D % 16 == 0
#else
#define ATTEND16 0
#endif

// Query tokens of one sequence (a prefill chunk) in blocks of up to ATT_QBLOCK share each work
// item: the chunk's K and V rows are located, fetched (and on AVX2 converted from float16) once
// for all of them. Each token's arithmetic is the one-token item's (the same chunks from its own
// context, the same operations), so results do not depend on the blocking.
// A work item runs a span of up to ATT_SPAN consecutive chunks and merges each row's chunk
// results (in a thread's scratch, in cache) into one part of the span; a token's spans are
// merged at the end. (One part per chunk went through memory: a 7,500-token prompt wrote and
// read back about 1 GB of them per layer.)
#define ATT_QBLOCK 16
#define ATT_SPAN 4
#define ATT_PARTS_MAX ((size_t)4 << 20)  // floats of span results per slab of tokens (16 MB)

// The keys j0 .. j0 + n - 1 (n <= ATT_CHUNK) of chunk c of token t's context, for KV head kvh:
// their element offsets in the caches (off; P = kv_pitch: elements from one (token, head) row to
// the next), whose lines are prefetched to L2 (K's, then V's) for `heads` heads from kvh (a key's
// heads are one run of memory: a thread that runs the next heads of the same keys next fetches
// theirs with kvh's); 0, none (they came with an earlier head's). Returns n.
static int chunk_rows(int t, int c, int kvh, const int *key0, const int *ctx, const int *seq,
                      const int32_t *block_tables, long bt_stride, int block_size, int kv_heads, size_t P,
                      const void *k_cache, const void *v_cache, size_t esize, int heads, size_t *off) {
    const int j0 = key0[t] + c * ATT_CHUNK;
    const int n = ctx[t] - j0 < ATT_CHUNK ? ctx[t] - j0 : ATT_CHUNK;
    const int32_t *table = block_tables + (size_t)seq[t] * bt_stride;
    const size_t kv_row = (size_t)kv_heads * P;
    for (int j = 0, b = j0 / block_size, slot = j0 % block_size; j < n; j++) {  // no division per row
        off[j] = ((size_t)table[b] * block_size + slot) * kv_row + (size_t)kvh * P;
        if (++slot == block_size) slot = 0, b++;
    }
    if (!heads) return n;
    const size_t len = (size_t)heads * P * esize;
    for (int j = 0; j < n; j++)
        for (size_t i = 0; i < len; i += 64) _mm_prefetch((const char *)k_cache + off[j] * esize + i, _MM_HINT_T1);
    for (int j = 0; j < n; j++)
        for (size_t i = 0; i < len; i += 64) _mm_prefetch((const char *)v_cache + off[j] * esize + i, _MM_HINT_T1);
    return n;
}

// chunk_rows' `heads` for KV head kvh's chunks where a thread claims `claim` consecutive heads of
// a span together (the first fetches every claimed head's part of the rows; 1: one head at a
// time, each its own part); drip: the rows come through att_prefetch instead (0).
static inline int rows_fetch(int claim, int drip, int kvh) { return drip ? 0 : kvh % claim ? 0 : claim; }

// How many keys of chunk c of token t's context (n_cur: the chunk's, as located for the block's
// last token) token t reads: its causal end may cut the chunk, or lie before it (0).
static inline int chunk_keys(int t, int c, const int *key0, const int *ctx, int n_cur) {
    const int j0 = key0[t] + c * ATT_CHUNK;  // key0 is the block's for every token
    return j0 >= ctx[t] ? 0 : ctx[t] - j0 < n_cur ? ctx[t] - j0 : n_cur;
}

#if ATTEND16
// Chunk c (n_cur keys at off) of the query block's tokens tb .. te - 1 for KV head kvh, on
// attention_avx512.h: each token's scores and softmax, then the weighted V sums of each run of
// consecutive tokens that read the same keys (the chunk's V rows once for the run). Results in
// ci: token t's head g at row (t - tb) * group + g. Inlined with constant D.
static inline __attribute__((always_inline)) void attend_block16(const float *q, long q_stride, int kvh, int group,
                                                                  int D, float scale, const void *k_cache,
                                                                  const void *v_cache, const size_t *off, int fmt,
                                                                  int tb, int te, int c, const int *key0,
                                                                  const int *ctx, int n_cur, float *scores,
                                                                  float *ci, att_prefetch *pf) {
    const size_t part_len = (size_t)D + 2;
    // scores: each token's group heads (rows of one token), or where a KV head serves one query head,
    // the runs of tokens that read the same keys, up to four rows sharing each K row's load
    for (int t = tb, u; t < te; t = u) {
        const int n = chunk_keys(t, c, key0, ctx, n_cur);
        u = t + 1;
        if (group == 1)
            while (u < te && chunk_keys(u, c, key0, ctx, n_cur) == n) u++;
        const size_t r0 = (size_t)(t - tb) * group;
        const int rows = group == 1 ? u - t : group;
        if (!n) continue;
        qk_rows(q + t * q_stride + (size_t)kvh * group * D, group == 1 ? (size_t)q_stride : (size_t)D, rows, D, scale,
                k_cache, off, fmt, n, scores + r0 * ATT_CHUNK, pf);
        softmax_rows(scores + r0 * ATT_CHUNK, rows, n, ci + r0 * part_len, part_len);
    }
    for (int t = tb, u; t < te; t = u) {
        const int n = chunk_keys(t, c, key0, ctx, n_cur);
        for (u = t + 1; u < te && chunk_keys(u, c, key0, ctx, n_cur) == n; u++) {}
        const size_t r0 = (size_t)(t - tb) * group;
        if (n) attend_values16(v_cache, off, fmt, n, scores + r0 * ATT_CHUNK, (u - t) * group, D,
                               ci + r0 * part_len + 2, part_len, pf);
    }
}
#endif

// Work item `item` = (span, KV head) of a query block (tokens bt[blk] .. bt[blk + 1] - 1 of one
// sequence, whose spans bspan[blk] .. bspan[blk + 1] - 1 are its last token's): *blk, *kvh, the
// span's index *s within the block and its chunk count *k (up to ATT_SPAN, fewer at the end).
static void locate_item(long item, int nblocks, const int *bt, const int *bspan, const int *nch, int kv_heads,
                        int *blk, int *kvh, int *s, int *k) {
    const long span = item / kv_heads;
    int lo = 0, hi = nblocks - 1;  // bspan[lo] <= span < bspan[lo + 1]
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (bspan[mid] <= span) lo = mid; else hi = mid - 1;
    }
    const int left = nch[bt[lo + 1] - 1] - (int)(span - bspan[lo]) * ATT_SPAN;
    *blk = lo, *kvh = (int)(item % kv_heads), *s = (int)(span - bspan[lo]), *k = left < ATT_SPAN ? left : ATT_SPAN;
}

// Queues for pf_drain the rows of work item `item`'s span from its KV head on (pf->len bytes of
// each: the heads of a claim; K rows, then V rows, chunk by chunk): every chunk's (only < 0) or
// chunk `only`'s; off: scratch for ATT_CHUNK offsets.
static void pf_push(att_prefetch *pf, long item, int only, int nblocks, const int *bt, const int *bspan,
                    const int *nch, const int *key0, const int *ctx, const int *seq, const int32_t *block_tables,
                    long bt_stride, int block_size, int kv_heads, size_t P, const void *k_cache, const void *v_cache,
                    size_t esize, size_t *off) {
    int blk, kvh, s, k;
    locate_item(item, nblocks, bt, bspan, nch, kv_heads, &blk, &kvh, &s, &k);
    for (int i = only < 0 ? 0 : only; i < (only < 0 ? k : only + 1); i++) {
        const int n = chunk_rows(bt[blk + 1] - 1, s * ATT_SPAN + i, kvh, key0, ctx, seq, block_tables, bt_stride,
                                 block_size, kv_heads, P, k_cache, v_cache, esize, 0, off);
        for (int j = 0; j < n; j++) pf->row[pf->n++] = (const char *)k_cache + off[j] * esize;
        for (int j = 0; j < n; j++) pf->row[pf->n++] = (const char *)v_cache + off[j] * esize;
    }
}

// Parts {max, sum, out[D]} p[0], p[stride], ... p[(nc - 1) * stride] of one row merged in order:
// *mx the largest max, *total and o[D] their sums and outputs weighted by w = exp(max - *mx),
// o 64 floats at a time in registers over a batch of parts.
#define MERGE_BATCH 64
static void merge_parts(const float *p, size_t stride, int nc, int D, float *mx_out, float *total_out, float *o) {
    float mx = p[0];
    for (int c = 1; c < nc; c++) mx = p[c * stride] > mx ? p[c * stride] : mx;
    float total = 0.0f, w[MERGE_BATCH];
    for (int c0 = 0; c0 < nc; c0 += MERGE_BATCH) {
        const int nb = nc - c0 < MERGE_BATCH ? nc - c0 : MERGE_BATCH;
        for (int c = 0; c < nb; c++) {
            w[c] = expf(p[(c0 + c) * stride] - mx);
            total += p[(c0 + c) * stride + 1] * w[c];
        }
        int d0 = 0;
        for (; d0 + 64 <= D; d0 += 64) {
            __m256 a[8];
            for (int i = 0; i < 8; i++) a[i] = c0 ? _mm256_loadu_ps(o + d0 + 8 * i) : _mm256_setzero_ps();
            for (int c = 0; c < nb; c++) {
                const float *pc = p + (c0 + c) * stride + 2 + d0;
                const __m256 wv = _mm256_set1_ps(w[c]);
                for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(_mm256_loadu_ps(pc + 8 * i), wv, a[i]);
            }
            for (int i = 0; i < 8; i++) _mm256_storeu_ps(o + d0 + 8 * i, a[i]);
        }
        for (; d0 < D; d0 += 8) {
            __m256 a = c0 ? _mm256_loadu_ps(o + d0) : _mm256_setzero_ps();
            for (int c = 0; c < nb; c++) a = _mm256_fmadd_ps(_mm256_loadu_ps(p + (c0 + c) * stride + 2 + d0), _mm256_set1_ps(w[c]), a);
            _mm256_storeu_ps(o + d0, a);
        }
    }
    *mx_out = mx, *total_out = total;
}

// Causal attention of every query token over its sequence's paged context. q [T, H, D] and
// out [T, H, D] with row strides in floats (heads at stride D); sequence b owns tokens
// query_start_loc[b] .. query_start_loc[b+1] - 1, the last of its seq_lens[b] context
// tokens. window > 0 (a sliding-window layer): a token attends to its last `window` positions
// only, itself included; the keys before are never read. The caches hold float32, float16 or
// int8 rows (fmt: KV_*, tl_kv_write's layout). Returns 0, or -1 out of memory.
int tl_paged_attention(const float *q, long q_stride, float *out, long out_stride, const void *k_cache,
                       const void *v_cache, const int32_t *query_start_loc, const int32_t *seq_lens,
                       const int32_t *block_tables, long bt_stride, int B, int H, int kv_heads, int D,
                       int block_size, float scale, int fmt, int window, int nthreads) {
    const int T = query_start_loc[B];
    const int group = H / kv_heads;
    const size_t part_len = (size_t)D + 2;
    // token t: sequence seq[t], keys lo[t] .. ctx[t] - 1, nch[t] chunks and nsp[t] spans (per KV head)
    int *seq = (int *)malloc(sizeof(int) * ((size_t)T + 1) * 8);
    if (!seq) return -1;
    int *ctx = seq + T + 1, *lo = ctx + T + 1, *nch = lo + T + 1, *nsp = nch + T + 1, *first = nsp + T + 1,
        *bt = first + T + 1, *bspan = bt + T + 1;
    for (int b = 0; b < B; b++)
        for (int t = query_start_loc[b]; t < query_start_loc[b + 1]; t++) {
            seq[t] = b;
            ctx[t] = seq_lens[b] - (query_start_loc[b + 1] - 1 - t);  // causal: up to itself
            lo[t] = window > 0 && ctx[t] > window ? ctx[t] - window : 0;
            nch[t] = (ctx[t] - lo[t] + ATT_CHUNK - 1) / ATT_CHUNK;
            nsp[t] = (nch[t] + ATT_SPAN - 1) / ATT_SPAN;
        }
    // The tokens run in slabs of at most ATT_PARTS_MAX floats of span results (a long prompt's
    // results whole would be hundreds of MB, paged in afresh at every layer); a token's items
    // and merges are the same in any slab.
    const size_t per_span = (size_t)kv_heads * group * part_len;
    size_t cap = ATT_PARTS_MAX, need = 0;  // a slab's floats: at least one token's, at most all of them
    for (int t = 0; t < T; t++) {
        cap = (size_t)nsp[t] * per_span > cap ? (size_t)nsp[t] * per_span : cap;
        need += (size_t)nsp[t] * per_span;
    }
    cap = need < cap ? need : cap;
    float *parts = (float *)malloc(sizeof(float) * (cap + 1));
    if (!parts) {
        free(seq);
        return -1;
    }
    int failed = 0;
    const size_t esize = kv_esize(fmt), P = kv_pitch(D, fmt);
    const int max_rows = ATT_QBLOCK * group;  // a block's rows (token, head) per KV head
    for (int t0 = 0, t1; t0 < T; t0 = t1) {
        // slab t0 .. t1 - 1: spans first[t] .. first[t + 1] - 1 of token t (from 0 at t0); query
        // block k: tokens bt[k] .. bt[k + 1] - 1, spans bspan[k] .. bspan[k + 1] - 1
        first[t0] = 0;
        int nblocks = 0;
        bt[0] = t0, bspan[0] = 0;
        for (t1 = t0;; t1++) {
            first[t1 + 1] = first[t1] + nsp[t1];
            const int slab_end = t1 + 1 == T || (size_t)(first[t1 + 1] + nsp[t1 + 1]) * per_span > cap;
            // a block also ends at its sequence's end and at ATT_QBLOCK tokens; a sliding-window
            // layer's tokens go one a block (their first keys differ, so their chunks do)
            if (slab_end || t1 + 1 == query_start_loc[seq[t1] + 1] || t1 + 1 - bt[nblocks] == ATT_QBLOCK ||
                window > 0) {
                bt[nblocks + 1] = t1 + 1;
                bspan[nblocks + 1] = bspan[nblocks] + nsp[t1];
                nblocks++;
            }
            if (slab_end) break;
        }
        t1++;
        const long items = (long)bspan[nblocks] * kv_heads;
        long claimed = 0;  // items handed out
        // Items go out `claim` consecutive heads of a span together: the most heads (a divisor of
        // kv_heads) that still leave `want` claims a thread (a span's keys' rows hold every head's
        // K or V in one run of memory: fetched with the claim's first head, the claim's part is in
        // cache for the others; where neighbouring heads run on other threads each reads its own
        // piece of every row, which the memory serves far below its streaming rate). The AVX2
        // tiles claim every head or one (their claim's first head fetches its rows in one burst:
        // runs of heads were slower). On the AVX-512 loops, a slab of decode tokens only (one
        // token a block) runs each claimed span chunk by chunk (below), from half as many claims;
        // the order of the work changes no result.
        const int tiles = !(ATTEND16 && D % 16 == 0);  // attend_item, else qk_rows, softmax_rows, attend_values16 (K, V in place)
        const int chunk_order = !tiles && nblocks == t1 - t0;
        const long want = (chunk_order ? 2L : 4L) * nthreads;
        int claim = kv_heads;
        while (claim > 1 && (kv_heads % claim || (long)bspan[nblocks] * (kv_heads / claim) < want))
            claim = tiles ? 1 : claim - 1;
#pragma omp parallel num_threads(nthreads)
        {
            // Where a thread claims several heads of a span on the AVX-512 loops (drip), it claims the
            // next span when it starts one and prefetches rows from inside the arithmetic of the
            // rows before them (att_prefetch); otherwise each chunk's rows are prefetched as the one
            // before it starts. Spans of query blocks run head by head (every chunk of a head, then
            // the next head), with the next span's rows queued whole; spans of decode tokens chunk by
            // chunk (chunk i of every claimed head, then chunk i + 1), with the next chunk's rows queued: a
            // chunk's rows of every head are one run of memory each, 512 KB for 32 KV heads of 64
            // float16 where a span of four chunks is 2 MB, more than L2 holds.
            const int drip = claim > 1 && !tiles, by_chunk = claim > 1 && chunk_order;
            // scores: a chunk's rows (the block's tokens' heads); cpart: a span's chunk results
            // (ATT_SPAN x the block's rows; by_chunk: ATT_SPAN x the token's heads, for every KV
            // head); rows: a chunk's rows for attend_item
            const size_t cpart_rows = by_chunk ? (size_t)kv_heads * ATT_SPAN * group : (size_t)ATT_SPAN * max_rows;
            const size_t cstride = (by_chunk ? (size_t)group : (size_t)max_rows) * part_len;  // a row's next chunk
            float *scores = (float *)malloc(sizeof(float) * ATT_CHUNK * (size_t)max_rows);
            float *cpart = (float *)malloc(sizeof(float) * cpart_rows * part_len);
            att_row *rows = (att_row *)malloc(sizeof(att_row) * (size_t)max_rows);
            size_t *off = (size_t *)malloc(sizeof(size_t) * 4 * ATT_CHUNK);  // two chunks' row offsets; dense ones; scratch
            att_prefetch pf = {drip ? (const char **)malloc(sizeof(char *) * 2 * ATT_SPAN * ATT_CHUNK) : NULL, 0, 0,
                               (size_t)claim * P * esize, 0};
            // the tiles' K columns, then (from a float16 or int8 cache) V rows as float32 (gather_rows)
            float *kt = tiles ? (float *)malloc(sizeof(float) * (fmt != KV_F32 ? 2 : 1) * ATT_CHUNK * (size_t)D) : NULL;
            const int ok = scores && cpart && rows && off && (pf.row || !drip) && (kt || !tiles);
            if (!ok) {
#pragma omp atomic write
                failed = 1;
            }
            // Chunks are located one ahead: while a thread works on one, the rows of the next it will
            // take (in its item, or the first of the next item it claims) are on their way from memory.
            size_t *off_cur = off, *off_next = off + ATT_CHUNK, *dense = off + 2 * ATT_CHUNK;
            int blk = 0, kvh = 0, s = 0, k = 0, i = 0, n_cur = 0;  // chunk i of the item's k
            long cur = ok ? __atomic_fetch_add(&claimed, claim, __ATOMIC_RELAXED) : items, ahead = items;
#define PUSH_CHUNK(item, i) pf_push(&pf, item, i, nblocks, bt, bspan, nch, lo, ctx, seq, block_tables, bt_stride, \
                                    block_size, kv_heads, P, k_cache, v_cache, esize, off + 3 * ATT_CHUNK)
#define PUSH_SPAN(item) PUSH_CHUNK(item, -1)
            if (ok) {
                for (int j = 0; j < ATT_CHUNK; j++) dense[j] = (size_t)j * D;
                if (cur < items) {
                    locate_item(cur, nblocks, bt, bspan, nch, kv_heads, &blk, &kvh, &s, &k);
                    if (drip) {  // the first span's (by_chunk: chunk's) rows at once, the next ones' from inside it
                        if (by_chunk) PUSH_CHUNK(cur, 0);
                        else PUSH_SPAN(cur);
                        pf_flush(&pf);
                        ahead = __atomic_fetch_add(&claimed, claim, __ATOMIC_RELAXED);
                        if (ahead < items && !by_chunk) PUSH_SPAN(ahead);
                    }
                    n_cur = chunk_rows(bt[blk + 1] - 1, s * ATT_SPAN, kvh, lo, ctx, seq, block_tables, bt_stride,
                                       block_size, kv_heads, P, k_cache, v_cache, esize,
                                       rows_fetch(claim, drip, kvh), off_cur);
                }
            }
            float *vrows = tiles && fmt != KV_F32 ? kt + (size_t)ATT_CHUNK * D : NULL;
            const float *vc = vrows ? vrows : (const float *)v_cache;
            while (cur < items) {
                if (by_chunk && kvh % claim == 0) {  // a chunk starts: the rest of its rows now, the next chunk's queued
                    pf_flush(&pf);
                    if (i + 1 < k) PUSH_CHUNK(cur, i + 1);
                    else if (ahead < items) PUSH_CHUNK(ahead, 0);
                }
                long next = cur;  // the item of the next chunk, and that chunk
                int nblk = blk, nkvh = kvh, ns = s, nk = k, ni = i + 1;
                if (by_chunk && ((kvh + 1) % claim || ni < k)) {  // the claim's next head's chunk i, else its first's chunk i + 1
                    if ((kvh + 1) % claim) next = cur + 1, nkvh = kvh + 1, ni = i;
                    else next = cur + 1 - claim, nkvh = kvh + 1 - claim;
                } else if (by_chunk || ni == k) {
                    if ((cur + 1) % claim) {
                        next = cur + 1;
                    } else if (drip) {  // the span claimed ahead (head by head: the rest of its rows now, and the one after it queued)
                        next = ahead;
                        if (!by_chunk) pf_flush(&pf);
                        ahead = next < items ? __atomic_fetch_add(&claimed, claim, __ATOMIC_RELAXED) : items;
                        if (ahead < items && !by_chunk) PUSH_SPAN(ahead);
                    } else {
                        next = __atomic_fetch_add(&claimed, claim, __ATOMIC_RELAXED);
                    }
                    ni = 0;
                    if (next < items) locate_item(next, nblocks, bt, bspan, nch, kv_heads, &nblk, &nkvh, &ns, &nk);
                }
                const int n_next = next < items ? chunk_rows(bt[nblk + 1] - 1, ns * ATT_SPAN + ni, nkvh, lo, ctx, seq,
                                                             block_tables, bt_stride, block_size, kv_heads, P, k_cache,
                                                             v_cache, esize, rows_fetch(claim, drip, nkvh), off_next)
                                                : 0;
                const int c = s * ATT_SPAN + i, tb = bt[blk];
                const size_t *voff = vrows ? dense : off_cur;
                if (tiles) {
                    keys_transposed(k_cache, fmt, off_cur, n_cur, D, kt);
                    if (vrows) gather_rows(v_cache, fmt, off_cur, n_cur, D, vrows);
                }
                // chunk i's results of the block's rows (token t's head g at row (t - tb) * group + g;
                // by_chunk: KV head kvh's own ATT_SPAN x group rows)
                float *cbase = by_chunk ? cpart + (size_t)kvh * ATT_SPAN * cstride : cpart;
                float *ci = cbase + (size_t)i * cstride;
                int nrows = 0;
#if ATTEND16
                if (!tiles) {
#define BLOCK16(d) attend_block16(q, q_stride, kvh, group, d, scale, k_cache, v_cache, off_cur, fmt, tb, \
                                  bt[blk + 1], c, lo, ctx, n_cur, scores, ci, drip ? &pf : NULL)
                    if (D == 64) BLOCK16(64);
                    else if (D == 128) BLOCK16(128);
                    else BLOCK16(D);
#undef BLOCK16
                }
#endif
                if (tiles)
                    for (int t = tb; t < bt[blk + 1]; t++) {
                        const int n = chunk_keys(t, c, lo, ctx, n_cur);
                        if (n == 0) continue;  // the chunk is past this token's context
                        const float *qh = q + t * q_stride + (size_t)kvh * group * D;
                        float *part = ci + (size_t)(t - tb) * group * part_len;
                        for (int g = 0; g < group; g++)
                            rows[nrows++] = (att_row){qh + (size_t)g * D, part + g * part_len, n};
                    }
                if (nrows) attend_item(rows, nrows, D, scale, kt, vc, voff, scores);
                if (i + 1 == k)  // the span's last chunk: each row's chunks merged into its span result
                    for (int t = tb; t < bt[blk + 1]; t++) {
                        const int nc = nch[t] - s * ATT_SPAN < k ? nch[t] - s * ATT_SPAN : k;
                        if (nc <= 0) continue;  // the span is past this token's context
                        for (int g = 0; g < group; g++) {
                            float *dst = parts + (((size_t)first[t] + s) * kv_heads + kvh) * group * part_len + g * part_len;
                            merge_parts(cbase + ((size_t)(t - tb) * group + g) * part_len, cstride, nc, D, dst, dst + 1,
                                        dst + 2);
                        }
                    }
                size_t *swap = off_cur;
                off_cur = off_next, off_next = swap;
                cur = next, blk = nblk, kvh = nkvh, s = ns, k = nk, i = ni, n_cur = n_next;
            }
#undef PUSH_SPAN
#undef PUSH_CHUNK
#pragma omp barrier
            // (every span is done) each (token, head)'s spans merged in order
#pragma omp for schedule(static)
            for (long th = (long)t0 * H; th < (long)t1 * H; th++) {
                const int t = (int)(th / H), h = (int)(th % H), kvh_h = h / group, g = h % group;
                const float *p0 = parts + ((size_t)first[t] * kv_heads + kvh_h) * group * part_len + g * part_len;
                float *o = out + t * out_stride + (size_t)h * D;
                float mx, total;
                merge_parts(p0, per_span, first[t + 1] - first[t], D, &mx, &total, o);
                const __m256 inv = _mm256_set1_ps(1.0f / total);
                for (int d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(o + d), inv));
            }
            free(scores);
            free(cpart);
            free(rows);
            free(off);
            free(pf.row);
            free(kt);
        }
    }
    free(parts);
    free(seq);
    return failed ? -1 : 0;
}

// ---- one Llama decoder layer in one call ------------------------------------------------------

// One weight of a projection, in the layout of the layer that holds it (tallow/models/quant.py,
// gguf_linear.py): kind TL_PART_Q4 (Q4Linear) or TL_PART_Q8 (Q8Linear), in tiles for linear();
// TL_PART_GGUF (GgufLinear: fmt one of linear_gguf.h's, sc / mn as there); TL_PART_HALF
// (HalfLinear: w [n, k] float16, or bfloat16 where fmt is 1).
enum { TL_PART_Q4 = 0, TL_PART_Q8 = 1, TL_PART_GGUF = 2, TL_PART_HALF = 3 };
typedef struct {
    const void *w;
    const uint16_t *d, *m;  // float16; m: Q4 and the GGUF formats with offsets, else NULL
    const uint8_t *sc, *mn;  // GGUF K-quant scales, else NULL
    const float *bias;  // may be NULL
    int kind, fmt, n, k;
} tl_part;

#define TL_MAX_PARTS 3
// A projection: its parts' outputs side by side (a fused q/k/v or gate/up whose parts the file
// stores in different formats: ConcatLinear), n columns in all.
typedef struct {
    tl_part part[TL_MAX_PARTS];
    int nparts, n;
} tl_proj;

// A layer's weights and shape, and its model's options (NULL / 0 where it has none): Qwen3's and
// Gemma 3's q/k norms; Gemma 3's sandwich norms (post_norm then normalizes the attention output
// before the residual add, pre_ff_norm comes before the MLP and post_ff_norm after it), GeGLU
// (act 1; 0: SiLU), sliding window (window > 0) and the rotary table of its local layers
// (cos_sin; NULL: the step's).
typedef struct {
    tl_proj qkv, o, gate_up, down;
    const float *in_norm, *post_norm;
    float eps, scale;
    int hidden, heads, kv_heads, head_dim, inter;
    const float *q_norm, *k_norm, *pre_ff_norm, *post_ff_norm, *cos_sin;
    int act, window;
} tl_layer;

typedef struct {
    int T, B, block_size, kv_fmt;  // kv_fmt: the KV caches' format (KV_*)
    long bt_stride;
    const int64_t *positions, *slot_mapping;
    const float *cos_sin;
    const int32_t *query_start_loc, *seq_lens, *block_tables;
    float *x, *qkv, *attn, *gate_up, *act;  // scratch: [T, hidden], [T, qkv], [T, heads*D], [T, 2I], [T, I]
} tl_step;

static int part_linear(const tl_part *p, const float *x, int M, float *y, int nthreads) {
    switch (p->kind) {
    case TL_PART_Q4:
    case TL_PART_Q8:
        return linear(x, M, p->k, p->n, (const uint8_t *)p->w, p->d, p->kind == TL_PART_Q8 ? NULL : p->m, p->bias, y,
                      nthreads, p->kind == TL_PART_Q8);
    case TL_PART_GGUF:
        return tl_gguf_linear(x, M, p->k, p->n, p->fmt, (const uint8_t *)p->w, p->d, p->m, p->sc, p->mn, p->bias, y,
                              nthreads);
    default:
        return tl_half_linear(x, M, p->k, p->n, (const uint16_t *)p->w, p->fmt, p->bias, y, nthreads);
    }
}

// The projection's output [M, n]: one part straight into y; several each into scratch, then
// copied into its columns (the same floats as ConcatLinear's torch.cat of the parts).
static int proj(const tl_proj *p, const float *x, int M, float *y, int nthreads) {
    if (p->nparts == 1) return part_linear(&p->part[0], x, M, y, nthreads);
    int widest = 0;
    for (int i = 0; i < p->nparts; i++) widest = p->part[i].n > widest ? p->part[i].n : widest;
    float *tmp = (float *)malloc(sizeof(float) * (size_t)M * widest);
    if (!tmp) return -1;
    int col = 0;
    for (int i = 0; i < p->nparts; i++) {
        const int n = p->part[i].n;
        if (part_linear(&p->part[i], x, M, tmp, nthreads)) {
            free(tmp);
            return -1;
        }
        for (int m = 0; m < M; m++) memcpy(y + (size_t)m * p->n + col, tmp + (size_t)m * n, sizeof(float) * n);
        col += n;
    }
    free(tmp);
    return 0;
}

// LlamaDecoderLayer.forward on float32 rows: (h, residual) -> (mlp output in h, residual).
// first: residual is not yet set (the first layer): residual = h.
int tl_llama_layer(const tl_layer *L, const tl_step *S, void *k_cache, void *v_cache, float *h, float *residual,
                   int first, int nthreads) {
    const int T = S->T, D = L->head_dim, q_dim = L->heads * D, kv_dim = L->kv_heads * D;
    const long qkv_stride = q_dim + 2 * kv_dim;
    tl_add_rms_norm(h, first ? NULL : residual, L->in_norm, L->eps, T, L->hidden, S->x, residual, nthreads);
    if (proj(&L->qkv, S->x, T, S->qkv, nthreads)) return -1;
    if (L->q_norm) tl_head_rms_norm(S->qkv, T, L->heads, D, qkv_stride, L->q_norm, L->eps, nthreads);
    if (L->k_norm) tl_head_rms_norm(S->qkv + q_dim, T, L->kv_heads, D, qkv_stride, L->k_norm, L->eps, nthreads);
    tl_rotary(S->qkv, T, L->heads + L->kv_heads, D, qkv_stride, S->positions, L->cos_sin ? L->cos_sin : S->cos_sin,
              nthreads);
    tl_kv_write(S->qkv + q_dim, qkv_stride, S->qkv + q_dim + kv_dim, qkv_stride, T, L->kv_heads, D, S->slot_mapping,
                k_cache, v_cache, S->kv_fmt);
    if (tl_paged_attention(S->qkv, qkv_stride, S->attn, q_dim, k_cache, v_cache, S->query_start_loc, S->seq_lens,
                           S->block_tables, S->bt_stride, S->B, L->heads, L->kv_heads, D, S->block_size, L->scale,
                           S->kv_fmt, L->window, nthreads))
        return -1;
    if (proj(&L->o, S->attn, T, h, nthreads)) return -1;
    if (L->pre_ff_norm) {  // sandwich: norm(attention output), then the residual add and the MLP's norm
        tl_add_rms_norm(h, NULL, L->post_norm, L->eps, T, L->hidden, S->x, h, nthreads);
        tl_add_rms_norm(S->x, residual, L->pre_ff_norm, L->eps, T, L->hidden, S->x, residual, nthreads);
    } else {
        tl_add_rms_norm(h, residual, L->post_norm, L->eps, T, L->hidden, S->x, residual, nthreads);
    }
    if (proj(&L->gate_up, S->x, T, S->gate_up, nthreads)) return -1;
    if (L->act) tl_gelu_tanh_and_mul(S->gate_up, T, L->inter, S->act, nthreads);
    else tl_silu_and_mul(S->gate_up, T, L->inter, S->act, nthreads);
    if (proj(&L->down, S->act, T, h, nthreads)) return -1;
    if (L->post_ff_norm) tl_add_rms_norm(h, NULL, L->post_ff_norm, L->eps, T, L->hidden, h, h, nthreads);
    return 0;
}
