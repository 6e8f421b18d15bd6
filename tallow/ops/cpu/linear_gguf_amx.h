// GGUF's 5-bit and K-quant layers (linear_gguf.h) on AMX tiles, for 5 rows and more, where
// tl_amx_enable() turned the tiles on (linear_amx.h). Included by linear_gguf.h in the AVX-512
// build: tl_gguf_linear runs gguf_amx_tile_rows in place of gguf_tile_rows.
//
// The same floats as tl_gguf_linear's AVX-512 loop: a block's integer dot products of 16 rows'
// int8 activations (signed) with the 16 channels' codes (unsigned) are one tile product
// (TDPBSUD; Q6_K: one per half of 16 inputs), exact in int32 as vpdpbusd's sums are; then
// gguf_row's float math per (row, channel), block by block in the same order. The unpacked block
// (gguf_unpack: quad v of the 16 channels in register v, byte 4c + i = q(c, 4v + i)) is the B
// operand as it is, and the activations are block-major (a block's rows 32 bytes apart): the A
// operand read in place.
//
// Tiles: 0 (C), 2 (A: n rows x 32 bytes), 3 (B: 8 x 64 bytes); Q6_K's halves: 0 and 1 (C),
// 4 and 5 (A: n x 16 bytes at xb and xb + 16), 6 and 7 (B: 4 x 64 bytes, quads 0-3 and 4-7).

__attribute__((target("amx-tile"))) static void gguf_amx_configure(int rows) {
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    c.colsb[0] = c.colsb[1] = 64, c.rows[0] = c.rows[1] = (uint8_t)rows;
    c.colsb[2] = 32, c.rows[2] = (uint8_t)rows;
    c.colsb[3] = 64, c.rows[3] = 8;
    c.colsb[4] = c.colsb[5] = 16, c.rows[4] = c.rows[5] = (uint8_t)rows;
    c.colsb[6] = c.colsb[7] = 64, c.rows[6] = c.rows[7] = 4;
    __asm__ volatile("ldtilecfg %0" : : "m"(c));  // (linear_amx.h says why not _tile_loadconfig)
}

// Block j's products (j < n) for the configured rows: A at xa + j * bs (rows 32 bytes apart),
// B at bt + 512 j; sums to cs + 512 j (rows x channels; Q6_K: the first half's, then the second's
// at + 256).
__attribute__((target("amx-tile,amx-int8"))) static void gguf_amx_blocks(const int8_t *xa, size_t bs,
                                                                         const uint8_t *bt, int n, int halves,
                                                                         int32_t *cs) {
    for (int j = 0; j < n; j++) {
        const int8_t *a = xa + bs * (size_t)j;
        const uint8_t *b = bt + 512 * (size_t)j;
        int32_t *c = cs + 512 * (size_t)j;
        if (halves) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_loadd(4, a, 32);
            _tile_loadd(5, a + 16, 32);
            _tile_loadd(6, b, 64);
            _tile_loadd(7, b + 256, 64);
            _tile_dpbsud(0, 4, 6);
            _tile_dpbsud(1, 5, 7);
            _tile_stored(0, c, 64);
            _tile_stored(1, c + 256, 64);
        } else {
            _tile_zero(0);
            _tile_loadd(2, a, 32);
            _tile_loadd(3, b, 64);
            _tile_dpbsud(0, 2, 3);
            _tile_stored(0, c, 64);
        }
    }
}

// Rows m0 .. m0 + rows - 1 through one tile (accumulators acc: GT per row, set here):
// gguf_tile_rows' arithmetic with the integer sums from the tiles.
static inline __attribute__((always_inline)) void gguf_amx_tile_rows(int planes, int zero, int halves, int has_m,
                                                                      int fmt, int nb, const uint8_t *wt,
                                                                      size_t block_bytes, const uint16_t *dt,
                                                                      const uint16_t *mt, const uint8_t *sct,
                                                                      const uint8_t *mnt, const qrows8 *r, int m0,
                                                                      int rows, float *acc, amx_scratch *s) {
    uint8_t *bt = s->bt;
    int32_t *cs = s->cs;
    float dw0[AMX_BATCH][GT], dw1[AMX_BATCH][GT], mw[AMX_BATCH][GT];
    for (int b0 = 0; b0 < nb; b0 += AMX_BATCH) {
        const int nj = nb - b0 < AMX_BATCH ? nb - b0 : AMX_BATCH;
        for (int j = 0; j < nj; j++) {
            const uint8_t *wb = wt + (size_t)(b0 + j) * block_bytes;
            for (size_t p = 0; p < block_bytes; p += 64)
                _mm_prefetch((const char *)(wb + 4 * block_bytes + p), _MM_HINT_T0);
            gblock W;
            gguf_unpack(wb, planes, &W);
            for (int v = 0; v < 8; v++) _mm512_store_si512((void *)(bt + 512 * j + 64 * v), W.w[v]);
            gguf_block_scales(fmt, b0 + j, dt, mt, sct, mnt, dw0[j], dw1[j], mw[j]);
        }
        const int configured = s->configured;  // (the groups' order: amx_group_start)
        for (int gi = 0; gi < (rows + 15) / 16; gi++) {
            const int g = amx_group_start(gi, rows, configured);
            const int n = rows - g < 16 ? rows - g : 16;
            if (s->configured != n) gguf_amx_configure(n), s->configured = n;
            gguf_amx_blocks(q8block(r, (size_t)(m0 + g), b0), r->bs, bt, nj, halves, cs);
            for (int i = 0; i < n; i++) {
                const size_t row = (size_t)(m0 + g + i);
                float *ai = acc + (size_t)(g + i) * GT;
                __m512 acc_v = b0 ? _mm512_loadu_ps(ai) : _mm512_setzero_ps();
                for (int j = 0; j < nj; j++) {  // gguf_row's float math (one sum: b = 0)
                    const size_t k = row * nb + b0 + j;
                    const int32_t *c = cs + 512 * j + 16 * i;
                    const __m512i a = _mm512_load_si512((const void *)c);
                    const __m512i b = halves ? _mm512_load_si512((const void *)(c + 256)) : _mm512_setzero_si512();
                    acc_v = gguf_scale(a, b, r->d[k], r->s[k], r->hs + 2 * k, zero, dw0[j], dw1[j], mw[j], halves, has_m,
                                       acc_v);
                }
                _mm512_storeu_ps(ai, acc_v);
            }
        }
    }
}
