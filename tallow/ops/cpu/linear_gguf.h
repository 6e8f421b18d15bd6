// Linear layers over GGUF's 5- and 6-bit and K-quant block formats (included by kernels.c after
// the Q4/Q8 kernels, in both builds): Q5_0, Q5_1, Q4_K, Q5_K, Q6_K. (Q4_0, Q4_1 and Q8_0 run on
// the Q4/Q8 kernels: Q4_0 is Q4_1 with m = -8 d.)
//
// The activations are int8 per block of 32 here (quantize_rows8: scale max|x| / 127), as
// llama.cpp's K-quant dot products take them (its q8_K: one scale per 256): the products are
// byte products, twice the int16 madds' rate on AVX2 (maddubs) and AVX-512 VNNI (vpdpbusd).
// On Gemma 3 270M's Q4_K_M file this moved the logits by up to 3.9% of the largest against
// transformers' float32 model of the same file (int16 activations: 0.015%), KL 2e-4 per token
// on average over 80 positions, the same argmax at each.
//
// The file's integer codes and scales are kept; only their order changes (tallow/models/
// gguf_linear.py repacks at load). Weights are in tiles of GT = 16 output channels in both
// builds (the last tile padded with zero channels); for tile t and sub-block b of 32 inputs,
// with quad v = inputs 4v..4v+3 (v = 0..7):
//   nib  256 bytes: the codes' low 4 bits, 4 groups of 64 bytes, group g's byte 4c + i =
//        q(c, 4g + i) & 15 | (q(c, 16 + 4g + i) & 15) << 4 (quads g and g + 4 of the 16
//        channels: one AVX-512 load, or two AVX2 loads of 8 channels each);
//   then `planes` (0, 1 or 2) bit planes of 64 bytes each, holding bit 4 + p of every code, in
//        one of two orders (the build's, tl_gguf_plane_layout):
//        words (AVX-512, GGUF_PLANE_LANES 0): 8 uint64, word v's bit 4c + i = bit 4 + p of
//        q(c, 4v + i) (a byte mask for quad v's vector);
//        lanes (AVX2, GGUF_PLANE_LANES 1): byte 4c + i's bit v = the same bit, so quad v's bits
//        are one shift and one mask of a loaded vector.
// So a block is 256, 320 or 384 bytes for 512 weights: 4, 5 or 6 bits per weight, as in the file.
// Unpacked, quad v of channel c is 4 unsigned bytes q(c, 4v + i) (0..63) in the 32-bit lane c
// (AVX2: lane c - 8h of half h's vector).
//
// Scales, float16 unless said otherwise, channels side by side:
//   Q5_0: d [tiles][nb][GT]                    w = d * (q - 16)
//   Q5_1: d, m [tiles][nb][GT]                 w = d * q + m
//   Q4_K, Q5_K: d, dmin [tiles][nb/8][GT]; sc, mn uint8 [tiles][nb][GT] (the 6-bit scales and
//         mins unpacked)                       w = (d * sc) * q - dmin * mn
//   Q6_K: d [tiles][nb/8][GT]; sc int8 [tiles][nb][2][GT] (one per 16 inputs)
//                                              w = (d * sc) * (q - 32)
// The integer dot product of a sub-block (Q6_K: of each half of 16) with the int8 activations
// is exact in int32: sum q * x - zero * sum x (zero = 16 for Q5_0, 32 for Q6_K, else 0; the
// activations' half sums come with them). Per output channel the float math then runs in this
// fixed order, block by block:
//   acc = fma(float(isum), dw * dx, acc)     dw = d (Q5_x) or d * sc (K: exact in float)
//   acc = fma(float(isum1), dw1 * dx, acc)   Q6_K's second half
//   acc = fma(mw, sx, acc)                   mw = m or -(dmin * mn); sx = dx * sum(q_x)
// whatever the rows around it and the threads (threads split the tiles), so a row's result does
// not depend on the batch, and both builds compute the same floats (lanes are channels in both).

#define GT 16
#define GCHUNK 64
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define GGUF_PLANE_LANES 0
#else
#define GGUF_PLANE_LANES 1
#endif

enum { TL_Q5_0 = 0, TL_Q5_1 = 1, TL_Q4_K = 2, TL_Q5_K = 3, TL_Q6_K = 4 };

static inline int gguf_planes(int fmt) { return fmt == TL_Q6_K ? 2 : fmt == TL_Q4_K ? 0 : 1; }
static inline int gguf_zero(int fmt) { return fmt == TL_Q5_0 ? 16 : fmt == TL_Q6_K ? 32 : 0; }
static inline int gguf_halves(int fmt) { return fmt == TL_Q6_K; }  // two scales per block of 32
static inline int gguf_has_m(int fmt) { return fmt != TL_Q5_0 && fmt != TL_Q6_K; }
// AVX2: rows a pass over an unpacked block (16 registers; AVX-VNNI needs no int16 partial sums,
// so one more row fits)
#if TL_VNNI256
#define GROWS 4
#else
#define GROWS 3
#endif

// AVX2: quads whose byte products may add up in int16 (the format's largest code: 15, 31, 63)
static inline int gguf_group(int fmt) { return fmt == TL_Q4_K ? 8 : fmt == TL_Q6_K ? 2 : 4; }

// The four bytes x[0..3] in every 32-bit lane.
static inline int32_t quad_of(const int8_t *x) {
    typedef int32_t __attribute__((may_alias)) quad;
    return *(const quad *)x;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)

typedef struct {
    __m512i w[8];  // quad v of the 16 channels
} gblock;

static inline __attribute__((always_inline)) void gguf_unpack(const uint8_t *blk, int planes, gblock *W) {
    const __m512i lo = _mm512_set1_epi8(0x0F);
    for (int g = 0; g < 4; g++) {
        const __m512i t = _mm512_loadu_si512((const void *)(blk + 64 * g));
        W->w[g] = _mm512_and_si512(t, lo);
        W->w[g + 4] = _mm512_and_si512(_mm512_srli_epi16(t, 4), lo);
    }
    const uint64_t *pl = (const uint64_t *)(blk + 256);
    for (int p = 0; p < planes; p++) {
        const __m512i bit = _mm512_set1_epi8((char)(16 << p));
        for (int v = 0; v < 8; v++) W->w[v] = _mm512_mask_add_epi8(W->w[v], _cvtu64_mask64(pl[8 * p + v]), W->w[v], bit);
    }
}

// One row through a block: the block's integer dot products with the row's 32 activations per
// channel (quads 0-3 and 4-7 apart: Q6_K's halves), then the float scale math of the top of
// this file on the GT channels' accumulators acc (dw0, dw1, mw: the block's float scales).
// The float math of the top of this file for one row and block: its integer sums a and b (Q6_K:
// the two halves; else the block's sum is a + b) scaled into the GT channels' accumulators
// acc_v, returned (dw0, dw1, mw: the block's float scales). linear_gguf_amx.h runs the same.
static inline __attribute__((always_inline)) __m512 gguf_scale(__m512i a, __m512i b, float dx, float sx,
                                                                const int16_t *hs, int zero, const float *dw0,
                                                                const float *dw1, const float *mw, int halves,
                                                                int has_m, __m512 acc_v) {
    const __m512 dxv = _mm512_set1_ps(dx);
    if (halves) {
        a = _mm512_sub_epi32(a, _mm512_set1_epi32(zero * hs[0]));
        b = _mm512_sub_epi32(b, _mm512_set1_epi32(zero * hs[1]));
        acc_v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_mul_ps(_mm512_loadu_ps(dw0), dxv), acc_v);
        acc_v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(b), _mm512_mul_ps(_mm512_loadu_ps(dw1), dxv), acc_v);
    } else {
        const __m512i s = _mm512_sub_epi32(_mm512_add_epi32(a, b), _mm512_set1_epi32(zero * (hs[0] + hs[1])));
        acc_v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(_mm512_loadu_ps(dw0), dxv), acc_v);
    }
    if (has_m) acc_v = _mm512_fmadd_ps(_mm512_loadu_ps(mw), _mm512_set1_ps(sx), acc_v);
    return acc_v;
}

// One row through a block: the block's integer dot products with the row's 32 activations per
// channel (quads 0-3 and 4-7 apart: Q6_K's halves), then gguf_scale on the GT channels'
// accumulators acc.
static inline __attribute__((always_inline)) void gguf_row(const gblock *W, const int8_t *xb, float dx, float sx,
                                                            const int16_t *hs, int zero, const float *dw0,
                                                            const float *dw1, const float *mw, int halves, int has_m,
                                                            float *acc) {
    __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();
    for (int v = 0; v < 4; v++) {
        a = _mm512_dpbusd_epi32(a, W->w[v], _mm512_set1_epi32(quad_of(xb + 4 * v)));
        b = _mm512_dpbusd_epi32(b, W->w[v + 4], _mm512_set1_epi32(quad_of(xb + 16 + 4 * v)));
    }
    _mm512_storeu_ps(acc, gguf_scale(a, b, dx, sx, hs, zero, dw0, dw1, mw, halves, has_m, _mm512_loadu_ps(acc)));
}

// R rows (row0 + i of r, accumulators acc + i * GT) through an unpacked block: gguf_row each.
static inline __attribute__((always_inline)) void gguf_rows(const gblock *W, const qrows8 *r, size_t row0, int R,
                                                             int nb, int b, int zero, int group, const float *dw0,
                                                             const float *dw1, const float *mw, int halves, int has_m,
                                                             float *acc) {
    (void)group;
    for (int i = 0; i < R; i++) {
        const size_t row = row0 + (size_t)i;
        gguf_row(W, q8block(r, row, b), r->d[row * nb + b], r->s[row * nb + b], r->hs + 2 * (row * nb + b), zero, dw0,
                 dw1, mw, halves, has_m, acc + (size_t)i * GT);
    }
}

// One row against one block (M = 1): the unpack and the row as above.
static inline __attribute__((always_inline)) void gguf_row1(const uint8_t *blk, int planes, int zero, int group,
                                                             const int8_t *xb, float dx, float sx, const int16_t *hs,
                                                             const float *dw0, const float *dw1, const float *mw,
                                                             int halves, int has_m, float *acc) {
    (void)group;
    gblock W;
    gguf_unpack(blk, planes, &W);
    gguf_row(&W, xb, dx, sx, hs, zero, dw0, dw1, mw, halves, has_m, acc);
}

#else

typedef struct {
    __m256i w[2][8];  // [h][v]: quad v of channels 8h..8h+7
} gblock;

// Plane p's bit for quad v, as a value: (bit v of each byte) << (4 + p), from the plane's half
// (32 bytes: channels 8h..8h+7); one shift and one mask (16-bit shifts: the mask keeps each
// byte's own bit).
static inline __attribute__((always_inline)) __m256i plane_bits(__m256i pl, int v, int p) {
    const int s = 4 + p - v;
    const __m256i t = s >= 0 ? _mm256_slli_epi16(pl, s) : _mm256_srli_epi16(pl, -s);
    return _mm256_and_si256(t, _mm256_set1_epi8((char)(16 << p)));
}

// Quads g and g + 4 of half h of a block, from its bytes.
static inline __attribute__((always_inline)) void gguf_quads(const uint8_t *blk, int planes, int h, int g, __m256i *lo,
                                                              __m256i *hi) {
    const __m256i m = _mm256_set1_epi8(0x0F);
    const __m256i t = _mm256_loadu_si256((const __m256i *)(blk + 64 * g + 32 * h));
    __m256i a = _mm256_and_si256(t, m), b = _mm256_and_si256(_mm256_srli_epi16(t, 4), m);
    for (int p = 0; p < planes; p++) {
        const __m256i pl = _mm256_loadu_si256((const __m256i *)(blk + 256 + 64 * p + 32 * h));
        a = _mm256_or_si256(a, plane_bits(pl, g, p));
        b = _mm256_or_si256(b, plane_bits(pl, g + 4, p));
    }
    *lo = a, *hi = b;
}

static inline __attribute__((always_inline)) void gguf_unpack(const uint8_t *blk, int planes, gblock *W) {
    for (int h = 0; h < 2; h++)
        for (int g = 0; g < 4; g++) gguf_quads(blk, planes, h, g, &W->w[h][g], &W->w[h][g + 4]);
}

// One row's integer sums of half h of a block (M = 1), the quads unpacked from blk as they are
// used: A over quads 0-3, B over 4-7 (group 8: A over all, B zero), each channel's in its 32-bit
// lane. The byte products (maddubs: a pair is at most 2 * 63 * 127) add up in int16 for
// `group` quads (Q4_K 8, the 5-bit formats 4, Q6_K 2: the most whose sum cannot pass 32767 for
// the format's largest code), then widen to int32 (madd by ones): exact, so the same integers
// as the many-row loop's (gguf_sums, gguf_rows_q6), which sum in another order.
static inline __attribute__((always_inline)) void gguf_half_sums1(const uint8_t *blk, int planes, int group, int h,
                                                                   const int8_t *x, __m256i *A, __m256i *B) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i a16 = _mm256_setzero_si256(), b16 = _mm256_setzero_si256();
    if (TL_VNNI256) *A = *B = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int g = 0; g < 4; g++) {
        __m256i wl, wh;
        gguf_quads(blk, planes, h, g, &wl, &wh);
        const __m256i xl = _mm256_set1_epi32(quad_of(x + 4 * g)), xh = _mm256_set1_epi32(quad_of(x + 16 + 4 * g));
#if TL_VNNI256  // quads 0-3 into A, 4-7 into B, in int32 at once (A + B is the same integer)
        *A = dpbusd256(*A, wl, xl), *B = dpbusd256(*B, wh, xh);
        continue;
#endif
        const __m256i pa = _mm256_maddubs_epi16(wl, xl), pb = _mm256_maddubs_epi16(wh, xh);
        if (group == 8) {
            a16 = g == 0 ? _mm256_add_epi16(pa, pb) : _mm256_add_epi16(a16, _mm256_add_epi16(pa, pb));
            continue;
        }
        a16 = g % group == 0 ? pa : _mm256_add_epi16(a16, pa);
        b16 = g % group == 0 ? pb : _mm256_add_epi16(b16, pb);
        if (g % group == group - 1) {
            const __m256i a32 = _mm256_madd_epi16(a16, ones), b32 = _mm256_madd_epi16(b16, ones);
            *A = g < group ? a32 : _mm256_add_epi32(*A, a32);
            *B = g < group ? b32 : _mm256_add_epi32(*B, b32);
        }
    }
    if (!TL_VNNI256 && group == 8) *A = _mm256_madd_epi16(a16, ones), *B = _mm256_setzero_si256();
}

// Channels 8h..8h+7 of a block for one row: the integer sums A, B (gguf_half_sums1) less the
// zero point's share, then the float math of the top of this file into acc: AVX-512's gguf_row
// for these channels.
static inline __attribute__((always_inline)) void gguf_half_out(__m256i A, __m256i B, int h, float dx, float sx,
                                                                 const int16_t *hs, int zero, const float *dw0,
                                                                 const float *dw1, const float *mw, int halves,
                                                                 int has_m, float *acc) {
    const __m256 dxv = _mm256_set1_ps(dx);
    __m256 acc_v = _mm256_loadu_ps(acc + 8 * h);
    if (halves) {
        A = _mm256_sub_epi32(A, _mm256_set1_epi32(zero * hs[0]));
        B = _mm256_sub_epi32(B, _mm256_set1_epi32(zero * hs[1]));
        acc_v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(A), _mm256_mul_ps(_mm256_loadu_ps(dw0 + 8 * h), dxv), acc_v);
        acc_v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(B), _mm256_mul_ps(_mm256_loadu_ps(dw1 + 8 * h), dxv), acc_v);
    } else {
        const __m256i s = _mm256_sub_epi32(_mm256_add_epi32(A, B), _mm256_set1_epi32(zero * (hs[0] + hs[1])));
        acc_v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(_mm256_loadu_ps(dw0 + 8 * h), dxv), acc_v);
    }
    if (has_m) acc_v = _mm256_fmadd_ps(_mm256_loadu_ps(mw + 8 * h), _mm256_set1_ps(sx), acc_v);
    _mm256_storeu_ps(acc + 8 * h, acc_v);
}

// R rows through an unpacked block, both halves of the channels at once (formats without
// halves): each row's quads broadcast once for the two. The int16 sums take quads g and g + 4
// for `group` / 2 steps of g (group 8: all eight quads, 4: four), then widen: A[i][h] is
// gguf_half_sums1's A + B.
static inline __attribute__((always_inline)) void gguf_sums(const gblock *W, const int8_t *x, size_t xs, int R,
                                                             int group, __m256i A[GROWS][2]) {
    const __m256i ones = _mm256_set1_epi16(1);
    const int steps = group / 2;  // steps of g per int16 sum
    __m256i s16[GROWS][2];
#pragma GCC unroll 4
    for (int g = 0; g < 4; g++) {
        const __m256i w0 = _mm256_load_si256(&W->w[0][g]), w1 = _mm256_load_si256(&W->w[1][g]);
        const __m256i w4 = _mm256_load_si256(&W->w[0][g + 4]), w5 = _mm256_load_si256(&W->w[1][g + 4]);
        for (int i = 0; i < R; i++) {
            const __m256i lo = _mm256_set1_epi32(quad_of(x + (size_t)i * xs + 4 * g));
            const __m256i hi = _mm256_set1_epi32(quad_of(x + (size_t)i * xs + 16 + 4 * g));
#if TL_VNNI256  // every quad into int32 at once
            A[i][0] = dpbusd256(dpbusd256(g == 0 ? _mm256_setzero_si256() : A[i][0], w0, lo), w4, hi);
            A[i][1] = dpbusd256(dpbusd256(g == 0 ? _mm256_setzero_si256() : A[i][1], w1, lo), w5, hi);
            continue;
#endif
            const __m256i p0 = _mm256_add_epi16(_mm256_maddubs_epi16(w0, lo), _mm256_maddubs_epi16(w4, hi));
            const __m256i p1 = _mm256_add_epi16(_mm256_maddubs_epi16(w1, lo), _mm256_maddubs_epi16(w5, hi));
            s16[i][0] = g % steps == 0 ? p0 : _mm256_add_epi16(s16[i][0], p0);
            s16[i][1] = g % steps == 0 ? p1 : _mm256_add_epi16(s16[i][1], p1);
            if (g % steps == steps - 1)
                for (int h = 0; h < 2; h++) {
                    const __m256i a32 = _mm256_madd_epi16(s16[i][h], ones);
                    A[i][h] = g < steps ? a32 : _mm256_add_epi32(A[i][h], a32);
                }
        }
#if TL_VNNI256
        for (int i = 0; i < R; i++) __asm__("" : "+x"(A[i][0]), "+x"(A[i][1]));  // kept in order: no spills
#else
        for (int i = 0; i < R; i++) __asm__("" : "+x"(s16[i][0]), "+x"(s16[i][1]));  // kept in order: no spills
#endif
    }
}

// Q6_K (group 2, halves): R rows through an unpacked block, both halves of the channels at once,
// quad by quad (each row's quad broadcast once for the two): the int16 sums take two quads, then
// widen; after quad 3 the first half of the inputs is done and goes into acc (gguf_half_out's
// first fma), after quad 7 the second.
static inline __attribute__((always_inline)) void gguf_rows_q6(const gblock *W, const qrows8 *r, size_t row0, int R,
                                                                int nb, int b, const float *dw0, const float *dw1,
                                                                float *acc) {
    const int8_t *x = q8block(r, row0, b);
    __m256i s32[GROWS][2];
#if !TL_VNNI256
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i s16[GROWS][2];
#endif
#pragma GCC unroll 8
    for (int v = 0; v < 8; v++) {
        const __m256i w0 = _mm256_load_si256(&W->w[0][v]), w1 = _mm256_load_si256(&W->w[1][v]);
        for (int i = 0; i < R; i++) {
            const __m256i xv = _mm256_set1_epi32(quad_of(x + (size_t)i * r->rs + 4 * v));
#if TL_VNNI256  // each quad into int32 at once
            for (int h = 0; h < 2; h++)
                s32[i][h] = dpbusd256(v % 4 == 0 ? _mm256_setzero_si256() : s32[i][h], h ? w1 : w0, xv);
#else
            const __m256i p0 = _mm256_maddubs_epi16(w0, xv), p1 = _mm256_maddubs_epi16(w1, xv);
            s16[i][0] = v % 2 == 0 ? p0 : _mm256_add_epi16(s16[i][0], p0);
            s16[i][1] = v % 2 == 0 ? p1 : _mm256_add_epi16(s16[i][1], p1);
            if (v % 2 == 1)
                for (int h = 0; h < 2; h++) {
                    const __m256i a32 = _mm256_madd_epi16(s16[i][h], ones);
                    s32[i][h] = v % 4 == 1 ? a32 : _mm256_add_epi32(s32[i][h], a32);
                }
#endif
            if (v % 4 == 3) {  // a half of the inputs done: (sum - 32 * its activations' sum) * dw * dx into acc
                const size_t k = (row0 + (size_t)i) * nb + b;
                const __m256 dxv = _mm256_set1_ps(r->d[k]);
                const __m256i z = _mm256_set1_epi32(32 * r->hs[2 * k + v / 4]);
                const float *dw = v < 4 ? dw0 : dw1;
                for (int h = 0; h < 2; h++) {
                    float *a = acc + (size_t)i * GT + 8 * h;
                    const __m256 sum = _mm256_cvtepi32_ps(_mm256_sub_epi32(s32[i][h], z));
                    _mm256_storeu_ps(a, _mm256_fmadd_ps(sum, _mm256_mul_ps(_mm256_loadu_ps(dw + 8 * h), dxv),
                                                        _mm256_loadu_ps(a)));
                }
            }
        }
#if TL_VNNI256
        for (int i = 0; i < R; i++) __asm__("" : "+x"(s32[i][0]), "+x"(s32[i][1]));  // kept in order: no spills
#else
        for (int i = 0; i < R; i++) __asm__("" : "+x"(s16[i][0]), "+x"(s16[i][1]));  // kept in order: no spills
#endif
    }
}

// R rows (row0 + i of r, accumulators acc + i * GT) through an unpacked block together: each
// quad vector is loaded once for the R rows (gguf_sums; Q6_K: gguf_rows_q6). R <= GROWS.
static inline __attribute__((always_inline)) void gguf_rows(const gblock *W, const qrows8 *r, size_t row0, int R,
                                                             int nb, int b, int zero, int group, const float *dw0,
                                                             const float *dw1, const float *mw, int halves, int has_m,
                                                             float *acc) {
    if (halves) {  // Q6_K
        gguf_rows_q6(W, r, row0, R, nb, b, dw0, dw1, acc);
        return;
    }
    __m256i A[GROWS][2];
    gguf_sums(W, q8block(r, row0, b), r->rs, R, group, A);
    for (int i = 0; i < R; i++) {
        const size_t k = (row0 + (size_t)i) * nb + b;
        for (int h = 0; h < 2; h++)
            gguf_half_out(A[i][h], _mm256_setzero_si256(), h, r->d[k], r->s[k], r->hs + 2 * k, zero, dw0, dw1, mw, 0,
                          has_m, acc + (size_t)i * GT);
    }
}

// One row against one block (M = 1), the quads unpacked as they are used (the same integers as
// gguf_unpack + gguf_rows, the same float math).
static inline __attribute__((always_inline)) void gguf_row1(const uint8_t *blk, int planes, int zero, int group,
                                                             const int8_t *xb, float dx, float sx, const int16_t *hs,
                                                             const float *dw0, const float *dw1, const float *mw,
                                                             int halves, int has_m, float *acc) {
    for (int h = 0; h < 2; h++) {
        __m256i A, B;
        gguf_half_sums1(blk, planes, group, h, xb, &A, &B);
        gguf_half_out(A, B, h, dx, sx, hs, zero, dw0, dw1, mw, halves, has_m, acc);
    }
}

#endif

// The GT channels' float scales of block b of a tile: dw0 (and Q6_K's dw1), mw (has_m formats).
// Eight channels at a time (F16C conversions and float32 products, exact conversions and one
// rounding per product: the floats of a scalar loop, in both builds).
static inline __m256 u8x8(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline __m256 i8x8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

static inline void gguf_block_scales(int fmt, int b, const uint16_t *d, const uint16_t *m, const uint8_t *sc,
                                     const uint8_t *mn, float *dw0, float *dw1, float *mw) {
    if (fmt == TL_Q5_0 || fmt == TL_Q5_1) {
        for (int c = 0; c < GT; c += 8) {
            _mm256_storeu_ps(dw0 + c, half8(d + GT * b + c));
            if (fmt == TL_Q5_1) _mm256_storeu_ps(mw + c, half8(m + GT * b + c));
        }
        return;
    }
    const int sb = b / 8;  // the super-block of 256
    if (fmt == TL_Q6_K) {
        const int8_t *s = (const int8_t *)sc + (size_t)2 * GT * b;
        for (int c = 0; c < GT; c += 8) {
            const __m256 dd = half8(d + GT * sb + c);
            _mm256_storeu_ps(dw0 + c, _mm256_mul_ps(dd, i8x8(s + c)));
            _mm256_storeu_ps(dw1 + c, _mm256_mul_ps(dd, i8x8(s + GT + c)));
        }
        return;
    }
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int c = 0; c < GT; c += 8) {  // Q4_K, Q5_K: dw0 = d * sc, mw = -(dmin * mn)
        _mm256_storeu_ps(dw0 + c, _mm256_mul_ps(half8(d + GT * sb + c), u8x8(sc + GT * b + c)));
        _mm256_storeu_ps(mw + c, _mm256_xor_ps(_mm256_mul_ps(half8(m + GT * sb + c), u8x8(mn + GT * b + c)), sign));
    }
}

// The loops below are compiled once per format: F(f) with f a constant, so each format's
// constants (gguf_planes, gguf_zero, ...) are constants in its body.
#define GGUF_FORMATS(F)               \
    case TL_Q4_K: F(TL_Q4_K); break;  \
    case TL_Q6_K: F(TL_Q6_K); break;  \
    case TL_Q5_K: F(TL_Q5_K); break;  \
    case TL_Q5_0: F(TL_Q5_0); break;  \
    default: F(TL_Q5_1); break;
#define GGUF_CONSTS(f) gguf_planes(f), gguf_zero(f), gguf_halves(f), gguf_has_m(f), gguf_group(f)

// y[1, N] (M = 1): tl_gguf_linear's loop for one row, through gguf_row1.
static inline __attribute__((always_inline)) void gguf_tile1(int planes, int zero, int halves, int has_m, int group,
                                                              int fmt, int nb, const uint8_t *wt, size_t block_bytes,
                                                              const uint16_t *dt, const uint16_t *mt,
                                                              const uint8_t *sct, const uint8_t *mnt,
                                                              const qrows8 *r, float *acc) {
    for (int c = 0; c < GT; c++) acc[c] = 0.0f;
    for (int b = 0; b < nb; b++) {
        const uint8_t *wb = wt + (size_t)b * block_bytes;
        for (size_t p = 0; p < block_bytes; p += 64) _mm_prefetch((const char *)(wb + 12 * block_bytes + p), _MM_HINT_T0);
        float dw0[GT], dw1[GT], mw[GT];
        gguf_block_scales(fmt, b, dt, mt, sct, mnt, dw0, dw1, mw);
        gguf_row1(wb, planes, zero, group, q8block(r, 0, b), r->d[b], r->s[b], r->hs + 2 * b, dw0, dw1, mw, halves,
                  has_m, acc);
    }
}

static __attribute__((noinline)) void gguf_gemv1(int K, int N, int fmt, const uint8_t *wq, const uint16_t *wd,
                                                 const uint16_t *wm, const uint8_t *wsc, const uint8_t *wmn,
                                                 const float *bias, float *y, int nthreads, const qrows8 *r) {
    const int nb = K / QK, tiles = (N + GT - 1) / GT;
    const int planes = gguf_planes(fmt), halves = gguf_halves(fmt), kq = fmt >= TL_Q4_K;
    const size_t block_bytes = 256 + (size_t)64 * planes, tile_bytes = (size_t)nb * block_bytes;
    const size_t d_per_tile = (size_t)(kq ? nb / 8 : nb) * GT;
    const size_t sc_per_tile = (size_t)nb * GT * (halves ? 2 : 1);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int t = 0; t < tiles; t++) {
        float acc[GT] __attribute__((aligned(32)));
        const uint8_t *wt = wq + (size_t)t * tile_bytes;
        const uint16_t *dt = wd + (size_t)t * d_per_tile, *mt = wm ? wm + (size_t)t * d_per_tile : NULL;
        const uint8_t *sct = wsc ? wsc + (size_t)t * sc_per_tile : NULL;
        const uint8_t *mnt = wmn ? wmn + (size_t)t * nb * GT : NULL;
#define TILE1(f) gguf_tile1(GGUF_CONSTS(f), f, nb, wt, block_bytes, dt, mt, sct, mnt, r, acc)
        switch (fmt) { GGUF_FORMATS(TILE1) }
#undef TILE1
        const int cols = N - t * GT < GT ? N - t * GT : GT;
        for (int c = 0; c < cols; c++) y[(size_t)t * GT + c] = bias ? acc[c] + bias[(size_t)t * GT + c] : acc[c];
    }
}

// Rows m0 .. m0 + rows - 1 through one tile (accumulators acc, zeroed by the caller): block by
// block, each block unpacked once for all the rows, taken 3 at a time.
static inline __attribute__((always_inline)) void gguf_tile_rows(int planes, int zero, int halves, int has_m,
                                                                  int group, int fmt, int nb, const uint8_t *wt,
                                                                  size_t block_bytes, const uint16_t *dt,
                                                                  const uint16_t *mt, const uint8_t *sct,
                                                                  const uint8_t *mnt, const qrows8 *r, int m0,
                                                                  int rows, float *acc) {
    const int R = GROWS;  // AVX2: 16 registers (AVX-512's gguf_rows takes any)
    for (int b = 0; b < nb; b++) {
        const uint8_t *wb = wt + (size_t)b * block_bytes;
        for (size_t p = 0; p < block_bytes; p += 64) _mm_prefetch((const char *)(wb + 4 * block_bytes + p), _MM_HINT_T0);
        gblock W;
        gguf_unpack(wb, planes, &W);
        float dw0[GT], dw1[GT], mw[GT];
        gguf_block_scales(fmt, b, dt, mt, sct, mnt, dw0, dw1, mw);
        int i = 0;
        for (; i + R <= rows; i += R)
            gguf_rows(&W, r, (size_t)(m0 + i), R, nb, b, zero, group, dw0, dw1, mw, halves, has_m, acc + (size_t)i * GT);
        if (R > 3 && rows - i == 3)
            gguf_rows(&W, r, (size_t)(m0 + i), 3, nb, b, zero, group, dw0, dw1, mw, halves, has_m, acc + (size_t)i * GT),
                i += 3;
        if (rows - i == 2)
            gguf_rows(&W, r, (size_t)(m0 + i), 2, nb, b, zero, group, dw0, dw1, mw, halves, has_m, acc + (size_t)i * GT),
                i += 2;
        for (; i < rows; i++)
            gguf_rows(&W, r, (size_t)(m0 + i), 1, nb, b, zero, group, dw0, dw1, mw, halves, has_m, acc + (size_t)i * GT);
    }
}

#ifdef TL_AMX
#include "linear_gguf_amx.h"  // the same loop on AMX tiles, for several rows where the CPU runs them
#endif

// y[M, N] = x[M, K] @ W^T (+ bias), W of format fmt in tiles (above); K % 32 == 0 (K formats:
// K % 256 == 0), tiles = ceil(N / GT). Returns 0, or -1 out of memory.
int tl_gguf_linear(const float *x, int M, int K, int N, int fmt, const uint8_t *wq, const uint16_t *wd,
                   const uint16_t *wm, const uint8_t *wsc, const uint8_t *wmn, const float *bias, float *y,
                   int nthreads) {
    const int nb = K / QK, tiles = (N + GT - 1) / GT, chunk = M < GCHUNK ? M : GCHUNK;
    const int planes = gguf_planes(fmt), halves = gguf_halves(fmt), kq = fmt >= TL_Q4_K;
    const size_t block_bytes = 256 + (size_t)64 * planes, tile_bytes = (size_t)nb * block_bytes;
    const size_t d_per_tile = (size_t)(kq ? nb / 8 : nb) * GT;  // d (and m/dmin) entries per tile
    const size_t sc_per_tile = (size_t)nb * GT * (halves ? 2 : 1);
    qrows8 r;
    // Many rows: block-major activations (a block's rows side by side; rows K bytes apart share
    // L1 sets where K is a multiple of 4,096, as 8,192 is).
    if (quantize_rows8(x, M, K, nthreads, M > 1, &r)) return -1;
    if (M == 1) {
        gguf_gemv1(K, N, fmt, wq, wd, wm, wsc, wmn, bias, y, nthreads, &r);
        free_rows8(&r);
        return 0;
    }
#ifdef TL_AMX
    const int on_tiles = amx_on && M >= GGUF_AMX_MIN_ROWS;  // the same floats (linear_gguf_amx.h)
#endif
    // many rows: tiles handed out by work_claim, else a static schedule (tile_walk, kernels.c)
    work_range *work = NULL;
    if (M >= STEAL_MIN_ROWS && !(work = work_ranges(nthreads, tiles))) {
        free_rows8(&r);
        return -1;
    }
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *acc = (float *)aligned_alloc(64, sizeof(float) * GT * (size_t)chunk);
#ifdef TL_AMX
        amx_scratch scratch = {0};
        const int broken = !acc || (on_tiles && amx_scratch_alloc(&scratch));
#else
        const int broken = !acc;
#endif
        if (broken) {
#pragma omp atomic write
            failed = 1;
        }
        tile_walk walk = tile_walk_start(work, nthreads, tiles);  // this thread's tiles
        for (int t; !broken && (t = next_tile(&walk)) >= 0;) {
            const uint8_t *wt = wq + (size_t)t * tile_bytes;
            const uint16_t *dt = wd + (size_t)t * d_per_tile, *mt = wm ? wm + (size_t)t * d_per_tile : NULL;
            const uint8_t *sct = wsc ? wsc + (size_t)t * sc_per_tile : NULL;
            const uint8_t *mnt = wmn ? wmn + (size_t)t * nb * GT : NULL;
            const int cols = N - t * GT < GT ? N - t * GT : GT;
            for (int m0 = 0; m0 < M; m0 += chunk) {
                const int rows = M - m0 < chunk ? M - m0 : chunk;
#ifdef TL_AMX
                if (on_tiles) {
#define AMX_ROWS(f)                                                                                                 \
    gguf_amx_tile_rows(gguf_planes(f), gguf_zero(f), gguf_halves(f), gguf_has_m(f), f, nb, wt, block_bytes, dt, mt, \
                       sct, mnt, &r, m0, rows, acc, &scratch)
                    switch (fmt) { GGUF_FORMATS(AMX_ROWS) }
#undef AMX_ROWS
                } else
#endif
                {
                    memset(acc, 0, sizeof(float) * GT * (size_t)rows);
#define ROWS(f) gguf_tile_rows(GGUF_CONSTS(f), f, nb, wt, block_bytes, dt, mt, sct, mnt, &r, m0, rows, acc)
                    switch (fmt) { GGUF_FORMATS(ROWS) }
#undef ROWS
                }
                for (int i = 0; i < rows; i++) {
                    float *yr = y + (size_t)(m0 + i) * N + (size_t)t * GT;
                    const float *a = acc + (size_t)i * GT;
                    for (int c = 0; c < cols; c++) yr[c] = bias ? a[c] + bias[(size_t)t * GT + c] : a[c];
                }
            }
        }
#ifdef TL_AMX
        amx_scratch_free(&scratch);
#endif
        free(acc);
    }
    free(work);
    free_rows8(&r);
    return failed ? -1 : 0;
}

int tl_gguf_tile_channels(void) { return GT; }
int tl_gguf_plane_layout(void) { return GGUF_PLANE_LANES; }  // 1: lanes, 0: words (the top of this file)

// ---- repacking a GGUF tensor's blocks into the kernels' tiles (at load) -----------------------

// GGML type ids (gguf.constants.GGMLQuantizationType) of the block formats repacked here.
enum { GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q5_0 = 6, GGML_Q5_1 = 7, GGML_Q8_0 = 8, GGML_Q4_K = 12, GGML_Q5_K = 13,
       GGML_Q6_K = 14 };

static inline uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

// Q4_K / Q5_K's 6-bit scale and min of sub-block j from the 12 packed bytes (get_scale_min_k4).
static inline void scale_min_k4(int j, const uint8_t *s, uint8_t *sc, uint8_t *mn) {
    if (j < 4) {
        *sc = s[j] & 63, *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

// The codes of one GGUF block (32 weights; the K formats: 256) as unsigned values q[] (Q8_0:
// int8 stored in uint8), and its float16 scale fields (d, m/dmin) as stored.
static void decode_block(int type, const uint8_t *blk, uint8_t *q, uint16_t *d, uint16_t *m) {
    switch (type) {
    case GGML_Q4_0:
    case GGML_Q4_1: {
        const uint8_t *qs = blk + (type == GGML_Q4_0 ? 2 : 4);
        *d = rd16(blk);
        if (type == GGML_Q4_1) *m = rd16(blk + 2);
        for (int j = 0; j < 16; j++) q[j] = qs[j] & 15, q[j + 16] = qs[j] >> 4;
        break;
    }
    case GGML_Q5_0:
    case GGML_Q5_1: {
        const int off = type == GGML_Q5_0 ? 2 : 4;
        uint32_t qh;
        memcpy(&qh, blk + off, 4);
        const uint8_t *qs = blk + off + 4;
        *d = rd16(blk);
        if (type == GGML_Q5_1) *m = rd16(blk + 2);
        for (int j = 0; j < 16; j++) {
            q[j] = (qs[j] & 15) | (((qh >> j) & 1) << 4);
            q[j + 16] = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
        }
        break;
    }
    case GGML_Q8_0:
        *d = rd16(blk);
        memcpy(q, blk + 2, 32);
        break;
    case GGML_Q4_K:
    case GGML_Q5_K: {
        *d = rd16(blk), *m = rd16(blk + 2);
        const uint8_t *qh = blk + 16, *qs = blk + (type == GGML_Q4_K ? 16 : 48);
        for (int i = 0; i < 8; i++)
            for (int l = 0; l < 32; l++) {
                uint8_t v = (qs[(i / 2) * 32 + l] >> ((i % 2) * 4)) & 15;
                if (type == GGML_Q5_K) v |= ((qh[l] >> i) & 1) << 4;
                q[i * 32 + l] = v;
            }
        break;
    }
    case GGML_Q6_K: {
        const uint8_t *ql = blk, *qh = blk + 128;
        *d = rd16(blk + 208);
        for (int h = 0; h < 2; h++)
            for (int r = 0; r < 128; r++)
                q[h * 128 + r] = ((ql[h * 64 + (r % 64)] >> (4 * (r / 64))) & 15) |
                                 (((qh[h * 32 + (r % 32)] >> (2 * (r / 32))) & 3) << 4);
        break;
    }
    }
}

static inline uint16_t half_times(uint16_t h, float f) { return _cvtss_sh(_cvtsh_ss(h) * f, 0); }

// A GGUF tensor's rows (raw: rows x cols weights in blocks of its type, rows back to back) into
// the tiles of `tile` output channels its kernel reads (all outputs zeroed by the caller, so
// padding channels are zero):
//   Q4_0, Q4_1 -> the Q4 layout of linear_avx512.h / linear_avx2.h (tiles of 16), Q4_0's
//     m = -8 d (exact in float16); Q8_0 -> the Q8 layout;
//   Q5_0, Q5_1, Q4_K, Q5_K, Q6_K -> this file's layout (tile 16), scales as listed at the top.
// Returns 0, or -1 for a type or tile it does not take.
int tl_gguf_repack(int type, const uint8_t *raw, int rows, int cols, int tile, uint8_t *wq, uint16_t *wd,
                   uint16_t *wm, uint8_t *wsc, uint8_t *wmn, int nthreads) {
    const int kq = type == GGML_Q4_K || type == GGML_Q5_K || type == GGML_Q6_K;
    const int q4 = type == GGML_Q4_0 || type == GGML_Q4_1, q8 = type == GGML_Q8_0;
    int block_bytes, fmt = -1;
    switch (type) {
    case GGML_Q4_0: block_bytes = 18; break;
    case GGML_Q4_1: block_bytes = 20; break;
    case GGML_Q5_0: block_bytes = 22, fmt = TL_Q5_0; break;
    case GGML_Q5_1: block_bytes = 24, fmt = TL_Q5_1; break;
    case GGML_Q8_0: block_bytes = 34; break;
    case GGML_Q4_K: block_bytes = 144, fmt = TL_Q4_K; break;
    case GGML_Q5_K: block_bytes = 176, fmt = TL_Q5_K; break;
    case GGML_Q6_K: block_bytes = 210, fmt = TL_Q6_K; break;
    default: return -1;
    }
    if ((q4 || q8) ? (tile != 4 && tile != 16) : tile != GT) return -1;
    const int per = kq ? 256 : 32, nblk = cols / per, nb = cols / QK, tiles = (rows + tile - 1) / tile;
    const size_t row_bytes = (size_t)nblk * block_bytes;
    const int planes = fmt >= 0 ? gguf_planes(fmt) : 0;
    const size_t gblock_bytes = 256 + (size_t)64 * planes;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int t = 0; t < tiles; t++) {
        uint8_t q[256];
        for (int c = 0; c < tile && t * tile + c < rows; c++) {
            const uint8_t *src = raw + (size_t)(t * tile + c) * row_bytes;
            for (int k = 0; k < nblk; k++) {
                uint16_t d = 0, m = 0;
                decode_block(type, src + (size_t)k * block_bytes, q, &d, &m);
                if (q4 || q8) {  // one block of 32
                    const size_t tb = (size_t)t * nb + k;
                    wd[tb * tile + c] = d;
                    if (q4) wm[tb * tile + c] = type == GGML_Q4_1 ? m : half_times(d, -8.0f);
                    if (q4 && tile == 4) {
                        for (int j = 0; j < 16; j++) wq[(tb * 4 + c) * 16 + j] = q[j] | (q[j + 16] << 4);
                    } else if (q4) {
                        for (int g = 0; g < 8; g++)
                            for (int e = 0; e < 2; e++)
                                wq[tb * 256 + 32 * g + 2 * c + e] = q[4 * g + e] | (q[4 * g + 2 + e] << 4);
                    } else if (tile == 4) {
                        memcpy(wq + (tb * 4 + c) * 32, q, 32);
                    } else {
                        for (int j = 0; j < 16; j++)
                            for (int e = 0; e < 2; e++) wq[tb * 512 + 32 * j + 2 * c + e] = q[2 * j + e];
                    }
                    continue;
                }
                const int subs = per / QK;  // blocks of 32 in this GGUF block
                if (kq) {
                    const size_t sb = (size_t)t * (nb / 8) + k;
                    wd[sb * GT + c] = d;
                    if (type != GGML_Q6_K) wm[sb * GT + c] = m;
                }
                for (int s = 0; s < subs; s++) {
                    const int b = k * subs + s;
                    const size_t tb = (size_t)t * nb + b;
                    const uint8_t *qb = q + 32 * s;
                    uint8_t *blk = wq + tb * gblock_bytes;
                    for (int g = 0; g < 4; g++)
                        for (int i = 0; i < 4; i++)
                            blk[64 * g + 4 * c + i] = (qb[4 * g + i] & 15) | ((qb[16 + 4 * g + i] & 15) << 4);
                    for (int p = 0; p < planes; p++)
                        for (int v = 0; v < 8; v++)
                            for (int i = 0; i < 4; i++) {
                                const int bit = (qb[4 * v + i] >> (4 + p)) & 1;
                                if (GGUF_PLANE_LANES)
                                    blk[256 + 64 * p + 4 * c + i] |= (uint8_t)(bit << v);
                                else
                                    ((uint64_t *)(blk + 256) + 8 * p)[v] |= (uint64_t)bit << (4 * c + i);
                            }
                    if (type == GGML_Q5_0 || type == GGML_Q5_1) {
                        wd[tb * GT + c] = d;
                        if (type == GGML_Q5_1) wm[tb * GT + c] = m;
                    } else if (type == GGML_Q6_K) {
                        const int8_t *scales = (const int8_t *)(src + (size_t)k * block_bytes + 192);
                        wsc[(tb * 2 + 0) * GT + c] = (uint8_t)scales[2 * s];
                        wsc[(tb * 2 + 1) * GT + c] = (uint8_t)scales[2 * s + 1];
                    } else {
                        scale_min_k4(s, src + (size_t)k * block_bytes + 4, wsc + tb * GT + c, wmn + tb * GT + c);
                    }
                }
            }
        }
    }
    return 0;
}

// ---- float16 / bfloat16 weights (GGUF F16, BF16), kept as stored --------------------------------

static inline __m256 load8_half(const uint16_t *p, int bf16) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (bf16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

// y[M, N] = x[M, K] @ W^T (+ bias), W [N, K] float16 (bf16: bfloat16) rows; K % 8 == 0. Each
// output is one dot product in float32 (two 8-lane FMA chains over K, summed in a fixed order),
// the same whatever the rows around it and the threads (threads split the channels).
int tl_half_linear(const float *x, int M, int K, int N, const uint16_t *w, int bf16, const float *bias, float *y,
                   int nthreads) {
    const int tiles = (N + 3) / 4;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int t = 0; t < tiles; t++) {  // 4 channels' rows stay in cache for every row of x
        const int n0 = t * 4, cols = N - n0 < 4 ? N - n0 : 4;
        for (int m = 0; m < M; m++) {
            const float *xr = x + (size_t)m * K;
            for (int c = 0; c < cols; c++) {
                const uint16_t *wr = w + (size_t)(n0 + c) * K;
                __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
                int i = 0;
                for (; i + 16 <= K; i += 16) {
                    a0 = _mm256_fmadd_ps(load8_half(wr + i, bf16), _mm256_loadu_ps(xr + i), a0);
                    a1 = _mm256_fmadd_ps(load8_half(wr + i + 8, bf16), _mm256_loadu_ps(xr + i + 8), a1);
                }
                if (i < K) a0 = _mm256_fmadd_ps(load8_half(wr + i, bf16), _mm256_loadu_ps(xr + i), a0);
                const float s = hsum8(_mm256_add_ps(a0, a1));
                y[(size_t)m * N + n0 + c] = bias ? s + bias[n0 + c] : s;
            }
        }
    }
    return 0;
}
