// The Q4/Q8 linear kernel on AMX tiles (included by linear_avx512.h: linear() runs it; used only
// after tl_amx_enable(), which cpu_native calls once a child process has run a tile
// instruction and lived: some machines list amx_int8 in /proc/cpuinfo and fault on it).
//
// It computes exactly the floats of linear() (linear_avx512.h), so which of the two runs a call
// (the number of rows decides) never changes a row's result. The AMX unit multiplies bytes:
// - Q4: the activations are 12-bit (quantize_rows: |x| <= 2047), each split into x = 16 h + l
//   (h = x >> 4, a signed byte; l = x & 15). A's row for a block holds the 32 l, then the 32 h;
//   B's 16 rows the block's codes q (0..15), then 16 q (0..240: still a byte). One TDPBSUD over
//   the 64 bytes gives sum(l q) + sum(h 16 q) = sum(x q), the block's exact integer dot product.
// - Q8: the activations are 16-bit, split into x = 256 hi + lo (hi its signed high byte, lo its
//   unsigned low byte); 256 q is no byte, so a block is two tile products (TDPBUSD of lo and
//   TDPBSSD of hi against the signed codes over the block's 32 inputs), combined as 256 hi + lo.
// Both sums are exact in int32 as vpdpwssd's are. Then the float math of linear() per (row,
// channel), block by block in the same order: acc = fma(float(sum), d_w * d_x, acc), and Q4's
// m term. (A tile product costs the same whatever its K, and the tile unit's work does not
// overlap the vector units': Q4's one product and one store a block instead of two took its
// layers at the default's shapes and 32 rows to 0.79-0.90x the time on a 2-core Xeon.)
//
// Tiles: C (16 rows x 16 int32: rows x channels): 0 (Q4; Q8's lo), 1 (Q8's hi); A (16 rows of a
// block): 5 (Q4: 64 bytes), 2 and 3 (Q8's lo and hi: 32 bytes); B (byte 4c + i of row v =
// the code of channel c at input 4v + i): 6 (Q4: 16 rows), 4 (Q8: 8 rows); unpacked from the
// tile layout of linear_avx512.h.

// Fewer rows: the VNNI kernels (the blocks' unpacking and the tile products' fixed cost are not
// paid back). Measured on a 2-core Xeon with AMX: Q8 (two tile products per block) wins from
// 8-12 rows; Q4 and the GGUF formats (one) from about 5 (Q4 at the default's shapes: 0.82-0.92x
// the VNNI kernel's time at 5 rows, 0.98-1.17x at 4).
#define AMX_MIN_ROWS_Q8 12
#define AMX_MIN_ROWS_Q4 5
#define GGUF_AMX_MIN_ROWS 5
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_ok = 0, amx_on = 0;  // the probe passed; the kernel in use

typedef struct {
    uint8_t palette, start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64))) amx_config;

// The tiles above, for a group of `rows` rows.
__attribute__((target("amx-tile"))) static void amx_configure(int rows) {
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 2; i++) c.colsb[i] = 64, c.rows[i] = (uint8_t)rows;
    for (int i = 2; i < 4; i++) c.colsb[i] = 32, c.rows[i] = (uint8_t)rows;
    c.colsb[4] = 64, c.rows[4] = 8;
    c.colsb[5] = 64, c.rows[5] = (uint8_t)rows;
    c.colsb[6] = 64, c.rows[6] = 16;
    // (not _tile_loadconfig: gcc's names an 8-byte operand, and the stores to the rest of the
    // configuration were dropped as dead)
    __asm__ volatile("ldtilecfg %0" : : "m"(c));
}

__attribute__((target("amx-tile"))) static void amx_release(void) { _tile_release(); }

// The M rows' activations as AMX operands, 64 bytes a block: xs[m][b] = the 32 low parts, then
// the 32 high parts (Q4: l = x & 15 and h = x >> 4; Q8: lo = x & 255 and hi = x >> 8).
static void amx_split_rows(const qrows *r, int M, int K, int nthreads, int q8, uint8_t *xs) {
    const int nb = K / QK, shift = q8 ? 8 : 4;
    const __m512i lo_bits = _mm512_set1_epi16(q8 ? 0xFF : 0x0F);
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M > 8)
    for (int m = 0; m < M; m++)
        for (int b = 0; b < nb; b++) {
            const __m512i v = _mm512_loadu_si512((const void *)(r->q + (size_t)m * K + (size_t)b * QK));
            uint8_t *dst = xs + ((size_t)m * nb + b) * 64;
            _mm256_storeu_si256((__m256i *)dst, _mm512_cvtepi16_epi8(_mm512_and_si512(v, lo_bits)));
            _mm256_storeu_si256((__m256i *)(dst + 32), _mm512_cvtepi16_epi8(_mm512_srai_epi16(v, shift)));
        }
}

// Block b of a tile as the B operand: Q8 8 rows of 64 bytes; Q4 16 (the codes, then 16 x them).
#define AMX_B_BYTES 1024
static inline __attribute__((always_inline)) void amx_unpack_block(const uint8_t *wb, int q8, uint8_t *bt) {
    if (q8) {  // group j holds byte 2c + e = q(c, 2j + e): row v takes groups 2v and 2v + 1
        for (int v = 0; v < 8; v++) {
            const __m512i g0 = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(wb + 64 * v)));
            const __m512i g1 = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(wb + 64 * v + 32)));
            _mm512_store_si512((void *)(bt + 64 * v), _mm512_or_si512(g0, _mm512_slli_epi32(g1, 16)));
        }
        return;
    }
    // Q4 group g: bytes 2c, 2c + 1 = q(c, 4g) | q(c, 4g + 2) << 4, q(c, 4g + 1) | q(c, 4g + 3) << 4.
    const __m512i nib = _mm512_set1_epi32(0x0F0F);
    for (int g = 0; g < 8; g++) {
        const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(wb + 32 * g)));
        const __m512i low = _mm512_and_si512(v, nib), high = _mm512_and_si512(_mm512_srli_epi32(v, 4), nib);
        const __m512i codes = _mm512_or_si512(low, _mm512_slli_epi32(high, 16));
        _mm512_store_si512((void *)(bt + 64 * g), codes);
        _mm512_store_si512((void *)(bt + 64 * (g + 8)), _mm512_slli_epi32(codes, 4));  // 16 q: no carry out of a byte
    }
}

// The tile products of n consecutive blocks for the configured rows: block j's A operands at
// xa + 64 j (rows `stride` bytes apart), its B at bt + AMX_B_BYTES j; its sums to cs + 512 j
// (16 x 16 int32, rows x channels; Q8: lo's, then hi's in the next 256). (Alternating two pairs
// of C tiles between blocks measured the same.)
__attribute__((target("amx-tile,amx-int8"))) static void amx_blocks(const uint8_t *xa, size_t stride, const uint8_t *bt,
                                                                    int n, int q8, int32_t *cs) {
    for (int j = 0; j < n; j++) {
        const uint8_t *a = xa + 64 * (size_t)j, *b = bt + AMX_B_BYTES * (size_t)j;
        int32_t *c = cs + 512 * (size_t)j;
        _tile_zero(0);
        if (!q8) {
            _tile_loadd(5, a, stride);
            _tile_loadd(6, b, 64);
            _tile_dpbsud(0, 5, 6);
            _tile_stored(0, c, 64);
            continue;
        }
        _tile_zero(1);
        _tile_loadd(2, a, stride);
        _tile_loadd(3, a + 32, stride);
        _tile_loadd(4, b, 64);
        _tile_dpbusd(0, 2, 4);
        _tile_dpbssd(1, 3, 4);
        _tile_stored(0, c, 64);
        _tile_stored(1, c + 256, 64);
    }
}

#define AMX_BATCH 8  // blocks whose products are stored before the float math reads them

// A call's rows run through the tiles in ceil(rows / 16) groups of 16, the last one shorter;
// group gi starts at the row this returns. The groups run starting with the size the tiles are
// configured for (`configured`, before the first group), so a batch of blocks reconfigures
// once, not twice (ldtilecfg costs ~3% of a 20-row step). Each row's sums are its own: the
// order moves no bit. (linear() and tl_gguf_linear's tile loops.)
static inline int amx_group_start(int gi, int rows, int configured) {
    const int ng = (rows + 15) / 16, last = rows - 16 * (ng - 1);
    return 16 * (ng > 1 && last != 16 && configured == last ? ng - 1 - gi : gi);
}

// linear()'s float math (block_scale), block by block, for rows g .. g + n - 1 of the chunk at
// m0 over blocks b0 .. b0 + nj - 1, their stored sums cs: acc (per row: dot, m) += ...
static inline __attribute__((always_inline)) void amx_scale(const int32_t *cs, const __m512 *d, const __m512 *mv,
                                                            int b0, int nj, int g, int n, const qrows *r, int nb,
                                                            int m0, int q4, int q8, float *acc) {
    for (int i = 0; i < n; i++) {
        const size_t m = (size_t)(m0 + g + i);
        const float *dx = r->d + m * nb + b0, *sx = r->s + m * nb + b0;
        float *ai = acc + (size_t)(g + i) * 2 * NT;
        __m512 a = b0 ? _mm512_load_ps(ai) : _mm512_setzero_ps();
        __m512 am = b0 ? _mm512_load_ps(ai + NT) : _mm512_setzero_ps();
        for (int j = 0; j < nj; j++) {
            const int32_t *c = cs + 512 * j + 16 * i;  // Q8: lo, and hi 256 further (x = 256 hi + lo)
            const __m512i c0 = _mm512_load_si512((const void *)c);
            const __m512i sum = q8 ? _mm512_add_epi32(c0, _mm512_slli_epi32(_mm512_load_si512((const void *)(c + 256)), 8)) : c0;
            block_scale(sum, d[j], mv[j], dx[j], sx[j], q4, &a, &am);
        }
        _mm512_store_ps(ai, a);
        _mm512_store_ps(ai + NT, am);
    }
}

// A thread's scratch for the tile kernels (linear() and tl_gguf_linear): a batch of blocks'
// stored products and unpacked B operands, and the row count its tiles are configured for.
typedef struct {
    int32_t *cs;
    uint8_t *bt;
    int configured;
} amx_scratch;

static int amx_scratch_alloc(amx_scratch *s) {
    s->cs = (int32_t *)aligned_alloc(64, sizeof(int32_t) * 512 * AMX_BATCH);
    s->bt = (uint8_t *)aligned_alloc(64, AMX_B_BYTES * AMX_BATCH);
    s->configured = 0;
    return s->cs && s->bt ? 0 : -1;
}

static void amx_scratch_free(amx_scratch *s) {
    if (s->configured) amx_release();
    free(s->cs), free(s->bt);
}

// linear()'s loop body on the tiles: rows m0 .. m0 + rows - 1 (operands xs, from
// amx_split_rows) through one tile of weights wt (scales dt, offsets mt or NULL) into acc (per
// row: dot, m). (Scaling one group's sums while the tiles run the next group's, from two
// buffers, measured slower: 1.1-1.3x the VNNI loop against 1.3-1.5x.)
static void amx_tile_rows(const uint8_t *wt, const uint16_t *dt, const uint16_t *mt, size_t block_bytes, int nb,
                          int q8, const qrows *r, const uint8_t *xs, int m0, int rows, float *acc, amx_scratch *s) {
    const size_t stride = (size_t)nb * 64;  // bytes from one row's operands to the next's
    __m512 d[AMX_BATCH], mv[AMX_BATCH];
    for (int b0 = 0; b0 < nb; b0 += AMX_BATCH) {
        const int nj = nb - b0 < AMX_BATCH ? nb - b0 : AMX_BATCH;
        for (int j = 0; j < nj; j++) {
            const uint8_t *wb = wt + (size_t)(b0 + j) * block_bytes;
            for (size_t p = 0; p < block_bytes; p += 64)
                _mm_prefetch((const char *)(wb + (q8 ? 2 : 1) * PREFETCH + p), _MM_HINT_T0);
            amx_unpack_block(wb, q8, s->bt + AMX_B_BYTES * j);
            d[j] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dt + NT * (b0 + j))));
            mv[j] = mt ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mt + NT * (b0 + j)))) : _mm512_setzero_ps();
        }
        const int configured = s->configured;
        for (int gi = 0; gi < (rows + 15) / 16; gi++) {
            const int g = amx_group_start(gi, rows, configured);
            const int n = rows - g < 16 ? rows - g : 16;
            if (s->configured != n) amx_configure(n), s->configured = n;
            amx_blocks(xs + (size_t)(m0 + g) * stride + (size_t)b0 * 64, stride, s->bt, nj, q8, s->cs);
            amx_scale(s->cs, d, mv, b0, nj, g, n, r, nb, m0, mt != NULL, q8, acc);
        }
    }
}

// Asks the kernel for the tile state (once per process), then checks both kinds of block
// product (Q4's one over 64 bytes, Q8's two over 32) against the same sums in integers. Returns
// 1 and turns the AMX kernel on, or 0. Run it in a child process first: where the CPU faults on
// tile instructions this dies of SIGILL.
__attribute__((target("amx-tile,amx-int8"))) int tl_amx_enable(void) {
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)) return 0;
    int8_t a[17 * 64];
    uint8_t b4[AMX_B_BYTES], b8[AMX_B_BYTES];
    int32_t c4[512], c8[512];
    for (int i = 0; i < 17 * 64; i++) a[i] = (int8_t)((i * 37) % 255 - 127);
    for (int i = 0; i < AMX_B_BYTES; i++) b4[i] = (uint8_t)((i * 11) % 256), b8[i] = (uint8_t)((i * 11) % 128);
    amx_configure(16);
    amx_blocks((const uint8_t *)a, 64, b4, 1, 0, c4);
    amx_blocks((const uint8_t *)a, 32, b8, 1, 1, c8);  // tile 3 (hi) reads a + 32 at a 32-byte stride: row m + 1
    amx_release();
    for (int m = 0; m < 16; m++)
        for (int ch = 0; ch < 16; ch++) {
            int32_t q4 = 0, lo = 0, hi = 0;
            for (int k = 0; k < 64; k++) q4 += a[64 * m + k] * b4[64 * (k / 4) + 4 * ch + k % 4];
            for (int k = 0; k < 32; k++) {
                const int q = b8[64 * (k / 4) + 4 * ch + k % 4];
                lo += (uint8_t)a[32 * m + k] * q;
                hi += a[32 * (m + 1) + k] * q;
            }
            if (c4[16 * m + ch] != q4 || c8[16 * m + ch] != lo || c8[256 + 16 * m + ch] != hi) return 0;
        }
    amx_ok = amx_on = 1;
    return 1;
}

// Turns the AMX kernel off (0) or on (1: only once tl_amx_enable has succeeded); returns whether
// it was on. For tests and benchmarks comparing the two kernels.
int tl_amx_set(int on) {
    const int was = amx_on;
    amx_on = on && amx_ok;
    return was;
}
