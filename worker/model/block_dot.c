/* Integer dot products of GGUF's weight blocks against activations quantised per row and group of
 * 32 on each call, in one int8 level, two in a group with an outlier (`quantise_rows`; llama.cpp's
 * Q8_1/Q8_0 are one everywhere): y = x @ W.T with
 * - `q4_linear`: W in groups of 32 four-bit values, w = d * q + m (q in 0..15, as GGUF's Q4_0 and
 *   Q4_1 store them: Q4_0's m is -8 d), AVX2 `vpmaddubsw` on the nibbles, or from 3 rows on a CPU
 *   with AVX-512 VNNI `vpdpbusd` on two tiles at once (the same bits, ~1.7x at a micro-turn's 16
 *   rows on Zen 5: docs/benchmarks.md, "AVX-512 VNNI for the appends");
 * - `q8_linear`: W in groups of 32 int8 values, w = d * q (GGUF's Q8_0), `vpmaddubsw` on |q| and the
 *   activations with q's sign.
 * One float scale product per group and level after the integer sums.
 *
 * Why it exists: on an AVX2 CPU without AVX-512 torch's packed int4 kernel is a near-scalar loop
 * (docs/benchmarks.md, "Weight forms"), and its cost grows ~3 ms a row on every CPU measured, so a
 * micro-turn's 33-row append cost as much as six decode steps.
 *
 * Invariants (the engine's promise: a session's tokens do not depend on its batch or its chunking):
 * - a row of y depends on its row of x alone: the activations' scales are per row and group, and
 *   every output is summed in one fixed order (groups in order, 8 float lanes, the integer sums
 *   exact), whatever the row count, the tiling or the thread count;
 * - threads split the output columns only, in tiles of 8 columns (pairs of tiles on the VNNI path).
 *
 * Weight layouts (`pack` in worker/model/linear_q4q8.py and linear_q8q8.py): tiles of 8 output rows.
 * q4: per tile and group 128 bytes of nibbles, as 4 vectors j of 8 rows x 4 stored bytes (bytes
 * 4j..4j+3 of the row's 16: low nibbles are values 4j..4j+3, high nibbles values 16+4j..16+4j+3),
 * and per tile and group 8 float16 scales d then 8 float16 offsets m.
 * q8: per tile and group 256 bytes, as 8 vectors k of 8 rows x 4 values (values 4k..4k+3), and per
 * tile and group 8 float16 scales d.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(__x86_64__) || defined(_M_X64)
#define BLOCK_DOT_X86 1
#include <immintrin.h>
#endif

#define GROUP 32
#define TILE 8
/* Activation rows computed together against one tile's unpacked weights (2, 3 and 4 measured: 4 the
 * fastest at 33 rows, docs/benchmarks.md). */
#define ROW_BLOCK 4
/* The AVX-512 VNNI path from this many activation rows: below it the AVX2 path reads the weights
 * faster (one stream a tile; a decode step's one or two rows are bound by that read, docs/benchmarks.md). */
#define VNNI_MIN_ROWS 3
/* Rows computed together on that path (4, 6 and 8 measured: 8 the fastest from 8 rows on). */
#define VNNI_ROW_BLOCK 8
/* Groups ahead of the one multiplied that a tile's weights are fetched for, on every path: the VNNI
 * path reads two tiles at once (8: ~8% at 16 rows on Zen 5; the hardware's own prefetch follows one
 * stream better than two), and a decode step's one row is bound by the read on the AVX2 paths too
 * (8: SmolLM2's 121 matrices at one row 10-16% faster on Zen 3, 16 the same; docs/benchmarks.md).
 * A hint: it changes no value. */
#define PREFETCH 8

#ifdef BLOCK_DOT_X86
/* One group of 32 values in four registers. */
typedef struct {
    __m256 v[4];
} Group;

/* Quantises one group to int8: d = max |v| / 127, q = v / d rounded to nearest even (the value
 * nearbyintf gives). Returns d; adds sum q to *sum; stores q as the group's 32 bytes in order, the
 * largest |v| in *largest and, where `levels` is not NULL, q as floats (what the second level
 * subtracts). The max is exact in any order. */
__attribute__((target("avx2,fma,f16c"))) static float quantise_group(const Group *group, int8_t *q, int *sum,
                                                                     float *largest_out, Group *levels) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        amax = _mm256_max_ps(_mm256_andnot_ps(sign, group->v[i]), amax);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, amax);
    float largest = 0.0f;
    for (int i = 0; i < 8; i++) {
        largest = lanes[i] > largest ? lanes[i] : largest;
    }
    *largest_out = largest;
    const float d = largest / 127.0f;
    const __m256 inverse = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
    __m256i t[4];
    __m256i total = _mm256_setzero_si256();
    for (int i = 0; i < 4; i++) {
        const __m256 scaled = _mm256_round_ps(_mm256_mul_ps(group->v[i], inverse),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        /* an infinity times 0 (a group holding an infinity has d = inf) gives NaN: it becomes 0, not
         * the -128 the saturating packs would make of it */
        const __m256 rounded = _mm256_and_ps(scaled, _mm256_cmp_ps(scaled, scaled, _CMP_ORD_Q));
        t[i] = _mm256_cvtps_epi32(rounded);
        total = _mm256_add_epi32(total, t[i]);
        if (levels) {
            levels->v[i] = rounded;
        }
    }
    /* packs interleave the 128-bit halves; the permutation puts the 32 bytes back in order */
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(t[0], t[1]), _mm256_packs_epi32(t[2], t[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    int32_t parts[8];
    _mm256_storeu_si256((__m256i *)parts, total);
    for (int i = 0; i < 8; i++) {
        *sum += parts[i];
    }
    return d;
}

/* A group whose largest |value| is more than this many times its mean |value| gets a second level.
 * Gaussian-like groups of 32 sit near 3; an outlier channel (LLMs' residual streams have a few)
 * crushes the rest of its group's values to a few levels of one int8 scale. SmolLM2 sends 9% of its
 * layers' input groups past 8, 19% of the down projection's, 31% of the output projection's. */
#define OUTLIER_RATIO 8.0f

/* Rows from which the quantisation is split between the threads (each row is its own: the same
 * values on any thread): below it a parallel region's fork and join cost more than a row's ~1 us. */
#define QUANTISE_PARALLEL_ROWS 4

/* Row r's groups: x ~ d_hi q_hi, and in a group past OUTLIER_RATIO + d_lo q_lo, q_lo quantising
 * what q_hi left (at most d_hi / 2 a value), so its values keep ~15 bits against the group's
 * largest instead of 8. One level everywhere (llama.cpp's Q8_1) lost SmolLM2's answer to "What is
 * the capital of France?" on top of the 4-bit weights (docs/benchmarks.md); a second level
 * everywhere kept it and cost ~1.6x in products; past the ratio only, ~1.0x. The choice reads the
 * row's own values only, in one fixed order (the sum of |v| in 8 lanes of 4 values, then the lanes
 * in order), so rows stay independent and a row's levels do not depend on the batch.
 * q [G][2][32] int8 (hi, then lo), scale [G][2] (d_hi, d_lo: 0 where there is no second level),
 * scaled sum [G] (d_hi sum q_hi + d_lo sum q_lo: the offsets' term of q4).
 * Vectorised, and split by rows between the threads from QUANTISE_PARALLEL_ROWS: the scalar form on
 * the calling thread was ~15% of a 16-row product on Zen 3 (nearbyintf a libm call a value). */
__attribute__((target("avx2,fma,f16c"))) static void quantise_rows(const float *x, int64_t rows, int64_t cols,
                                                                   int8_t *q, float *scale, float *scaled_sum,
                                                                   int threads) {
    const int64_t groups = cols / GROUP;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && rows >= QUANTISE_PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        const __m256 sign = _mm256_set1_ps(-0.0f);
        for (int64_t g = 0; g < groups; g++) {
            const int64_t at = r * groups + g;
            const float *v = x + r * cols + g * GROUP;
            int8_t *hi = q + at * 2 * GROUP;
            Group group, levels;
            __m256 magnitude = _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) {
                /* a NaN (a broken checkpoint's activation) is read as 0: its row comes out as with a 0
                 * there, its group's scales and outlier level included */
                const __m256 loaded = _mm256_loadu_ps(v + 8 * i);
                group.v[i] = _mm256_and_ps(loaded, _mm256_cmp_ps(loaded, loaded, _CMP_ORD_Q));
                magnitude = _mm256_add_ps(magnitude, _mm256_andnot_ps(sign, group.v[i]));
            }
            int hi_sum = 0, lo_sum = 0;
            float largest, unused;
            const float d_hi = quantise_group(&group, hi, &hi_sum, &largest, &levels);
            float lanes[8];
            _mm256_storeu_ps(lanes, magnitude);
            float total = 0.0f;
            for (int i = 0; i < 8; i++) {
                total += lanes[i];
            }
            float d_lo = 0.0f; /* 0: no second level (the products skip it) */
            if (largest * GROUP > OUTLIER_RATIO * total) {
                /* what the first level left: v - d_hi q_hi, a product then a difference (the file is
                 * built with -ffp-contract=off, so never one fused multiply-add) */
                Group rest;
                const __m256 step = _mm256_set1_ps(d_hi);
                for (int i = 0; i < 4; i++) {
                    rest.v[i] = _mm256_sub_ps(group.v[i], _mm256_mul_ps(step, levels.v[i]));
                }
                d_lo = quantise_group(&rest, hi + GROUP, &lo_sum, &unused, NULL);
            }
            scale[2 * at] = d_hi;
            scale[2 * at + 1] = d_lo;
            scaled_sum[at] = d_hi * (float)hi_sum + d_lo * (float)lo_sum;
        }
    }
}

/* Four activation bytes broadcast to every lane: a load, no shuffle (a float load moves the bits). */
#define CHUNK(k) _mm256_castps_si256(_mm256_broadcast_ss(chunk + (k)))

__attribute__((target("avx2,fma,f16c"))) static void q4_product(const int8_t *q, const float *scale,
                                                                const float *scaled_sum, int64_t rows,
                                                                int64_t groups, const uint8_t *packed,
                                                                const uint16_t *scales, int64_t columns,
                                                                int64_t out_features, float *y, int threads) {
    const int64_t tiles = columns / TILE;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t t = 0; t < tiles; t++) {
        const __m256i low = _mm256_set1_epi8(0x0F);
        const __m256i ones = _mm256_set1_epi16(1);
        const uint8_t *tile = packed + t * groups * 128;
        const uint16_t *tile_scales = scales + t * groups * 2 * TILE;
        for (int64_t r = 0; r < rows; r += ROW_BLOCK) {
            const int block = rows - r < ROW_BLOCK ? (int)(rows - r) : ROW_BLOCK;
            __m256 acc[ROW_BLOCK], acc_offset[ROW_BLOCK];
            for (int b = 0; b < ROW_BLOCK; b++) {
                acc[b] = _mm256_setzero_ps();
                acc_offset[b] = _mm256_setzero_ps();
            }
            for (int64_t g = 0; g < groups; g++) {
                __m256i w[8];
                _mm_prefetch((const char *)(tile + (g + PREFETCH) * 128), _MM_HINT_T0);
                _mm_prefetch((const char *)(tile + (g + PREFETCH) * 128 + 64), _MM_HINT_T0);
                for (int j = 0; j < 4; j++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(tile + g * 128 + j * 32));
                    w[j] = _mm256_and_si256(v, low);
                    w[j + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                }
                const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tile_scales + g * 2 * TILE)));
                const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tile_scales + g * 2 * TILE + TILE)));
                for (int b = 0; b < block; b++) {
                    const int64_t at = (r + b) * groups + g;
                    for (int level = 0; level < 2; level++) {
                        if (level == 1 && scale[2 * at + 1] == 0.0f) {
                            break;
                        }
                        const float *chunk = (const float *)(q + (2 * at + level) * GROUP);
                        /* 8 products of at most 2 * 15 * 127 each: the int16 sums cannot overflow. */
                        __m256i s = _mm256_maddubs_epi16(w[0], CHUNK(0));
                        for (int k = 1; k < 8; k++) {
                            s = _mm256_add_epi16(s, _mm256_maddubs_epi16(w[k], CHUNK(k)));
                        }
                        const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(s, ones));
                        acc[b] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, _mm256_set1_ps(scale[2 * at + level])), acc[b]);
                    }
                    acc_offset[b] = _mm256_fmadd_ps(m, _mm256_set1_ps(scaled_sum[at]), acc_offset[b]);
                }
            }
            for (int b = 0; b < block; b++) {
                _mm256_storeu_ps(y + (r + b) * out_features + t * TILE, _mm256_add_ps(acc[b], acc_offset[b]));
            }
        }
    }
}

/* The same products on AVX-512 with VNNI, two tiles (16 output rows) to a register: `vpdpbusd` sums
 * four nibble x int8 products into each int32 lane, the exact integers `vpmaddubsw`, `vpaddw` and
 * `vpmaddwd` reach above (no int16 sum there overflows). The float part is the AVX2 path's
 * operations lane for lane, in the same order, so the outputs are equal bit for bit (a worker's tokens
 * do not depend on which of the two its CPU runs; tests/worker/test_block_dot.py). A last odd tile
 * goes through the AVX2 path. */

#define CHUNK512(k) _mm512_broadcastd_epi32(_mm_loadu_si32(chunk + (k)))

__attribute__((target("avx512f,avx512bw,avx512vnni,avx2,fma,f16c"))) static void q4_product_vnni(
    const int8_t *q, const float *scale, const float *scaled_sum, int64_t rows, int64_t groups,
    const uint8_t *packed, const uint16_t *scales, int64_t pairs, int64_t out_features, float *y, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t p = 0; p < pairs; p++) {
        const __m512i low = _mm512_set1_epi8(0x0F);
        const uint8_t *tile_a = packed + 2 * p * groups * 128;
        const uint8_t *tile_b = tile_a + groups * 128;
        const uint16_t *scales_a = scales + 2 * p * groups * 2 * TILE;
        const uint16_t *scales_b = scales_a + groups * 2 * TILE;
        for (int64_t r = 0; r < rows; r += VNNI_ROW_BLOCK) {
            const int block = rows - r < VNNI_ROW_BLOCK ? (int)(rows - r) : VNNI_ROW_BLOCK;
            __m512 acc[VNNI_ROW_BLOCK], acc_offset[VNNI_ROW_BLOCK];
            for (int b = 0; b < VNNI_ROW_BLOCK; b++) {
                acc[b] = _mm512_setzero_ps();
                acc_offset[b] = _mm512_setzero_ps();
            }
            for (int64_t g = 0; g < groups; g++) {
                __m512i w[8];
                _mm_prefetch((const char *)(tile_a + (g + PREFETCH) * 128), _MM_HINT_T0);
                _mm_prefetch((const char *)(tile_a + (g + PREFETCH) * 128 + 64), _MM_HINT_T0);
                _mm_prefetch((const char *)(tile_b + (g + PREFETCH) * 128), _MM_HINT_T0);
                _mm_prefetch((const char *)(tile_b + (g + PREFETCH) * 128 + 64), _MM_HINT_T0);
                for (int j = 0; j < 4; j++) {
                    const __m256i a = _mm256_loadu_si256((const __m256i *)(tile_a + g * 128 + j * 32));
                    const __m256i b = _mm256_loadu_si256((const __m256i *)(tile_b + g * 128 + j * 32));
                    const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
                    w[j] = _mm512_and_si512(v, low);
                    w[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                }
                const __m128i d_a = _mm_loadu_si128((const __m128i *)(scales_a + g * 2 * TILE));
                const __m128i d_b = _mm_loadu_si128((const __m128i *)(scales_b + g * 2 * TILE));
                const __m128i m_a = _mm_loadu_si128((const __m128i *)(scales_a + g * 2 * TILE + TILE));
                const __m128i m_b = _mm_loadu_si128((const __m128i *)(scales_b + g * 2 * TILE + TILE));
                const __m512 d = _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(d_a), d_b, 1));
                const __m512 m = _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(m_a), m_b, 1));
                for (int b = 0; b < block; b++) {
                    const int64_t at = (r + b) * groups + g;
                    for (int level = 0; level < 2; level++) {
                        if (level == 1 && scale[2 * at + 1] == 0.0f) {
                            break;
                        }
                        const int8_t *chunk = q + (2 * at + level) * GROUP;
                        /* two chains, so each vpdpbusd waits on the one before it half as often */
                        __m512i even = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], CHUNK512(0));
                        __m512i odd = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[1], CHUNK512(4));
                        for (int k = 2; k < 8; k += 2) {
                            even = _mm512_dpbusd_epi32(even, w[k], CHUNK512(4 * k));
                            odd = _mm512_dpbusd_epi32(odd, w[k + 1], CHUNK512(4 * k + 4));
                        }
                        const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(even, odd));
                        acc[b] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(scale[2 * at + level])), acc[b]);
                    }
                    acc_offset[b] = _mm512_fmadd_ps(m, _mm512_set1_ps(scaled_sum[at]), acc_offset[b]);
                }
            }
            for (int b = 0; b < block; b++) {
                _mm512_storeu_ps(y + (r + b) * out_features + 2 * p * TILE, _mm512_add_ps(acc[b], acc_offset[b]));
            }
        }
    }
}
__attribute__((target("avx2,fma,f16c"))) static void q8_product(const int8_t *q, const float *scale,
                                                                   int64_t rows, int64_t groups,
                                                                   const uint8_t *packed, const uint16_t *scales,
                                                                   int64_t out_features, float *y, int threads) {
    const int64_t tiles = out_features / TILE;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t t = 0; t < tiles; t++) {
        const __m256i ones = _mm256_set1_epi16(1);
        const uint8_t *tile = packed + t * groups * 256;
        const uint16_t *tile_scales = scales + t * groups * TILE;
        for (int64_t r = 0; r < rows; r += ROW_BLOCK) {
            const int block = rows - r < ROW_BLOCK ? (int)(rows - r) : ROW_BLOCK;
            __m256 acc[ROW_BLOCK];
            for (int b = 0; b < ROW_BLOCK; b++) {
                acc[b] = _mm256_setzero_ps();
            }
            for (int64_t g = 0; g < groups; g++) {
                __m256i w[8], magnitude[8];
                for (int line = 0; line < 256; line += 64) {
                    _mm_prefetch((const char *)(tile + (g + PREFETCH) * 256 + line), _MM_HINT_T0);
                }
                for (int k = 0; k < 8; k++) {
                    w[k] = _mm256_loadu_si256((const __m256i *)(tile + g * 256 + k * 32));
                    magnitude[k] = _mm256_sign_epi8(w[k], w[k]);
                }
                const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tile_scales + g * TILE)));
                for (int b = 0; b < block; b++) {
                    const int64_t at = (r + b) * groups + g;
                    for (int level = 0; level < 2; level++) {
                        if (level == 1 && scale[2 * at + 1] == 0.0f) {
                            break;
                        }
                        const float *chunk = (const float *)(q + (2 * at + level) * GROUP);
                        /* |w| * (x with w's sign): at most 2 * 127 * 127 a pair, so each chunk goes to int32. */
                        __m256i s = _mm256_setzero_si256();
                        for (int k = 0; k < 8; k++) {
                            const __m256i signed_x = _mm256_sign_epi8(CHUNK(k), w[k]);
                            s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude[k], signed_x), ones));
                        }
                        const __m256 dot = _mm256_cvtepi32_ps(s);
                        acc[b] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, _mm256_set1_ps(scale[2 * at + level])), acc[b]);
                    }
                }
            }
            for (int b = 0; b < block; b++) {
                _mm256_storeu_ps(y + (r + b) * out_features + t * TILE, acc[b]);
            }
        }
    }
}
#endif

static int cpu_supported(void) {
#ifdef BLOCK_DOT_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
    return 0;
#endif
}

static int vnni_supported(void) {
#ifdef BLOCK_DOT_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vnni");
#else
    return 0;
#endif
}

static PyObject *supported(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyBool_FromLong(cpu_supported());
}

static PyObject *vnni(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyBool_FromLong(vnni_supported());
}

/* Quantise x, then multiply: `bits` 4 (q4_product, or q4_product_vnni where the CPU has it) or 8
 * (q8_product). Addresses as ints: the caller owns contiguous tensors, x [rows, cols] float32 and
 * y [rows, out_features] float32. An optional last argument false keeps q4 on the AVX2 path (the two
 * give the same bits; tests compare them). */
static PyObject *multiply(int bits, PyObject *args) {
    Py_ssize_t x_at, packed_at, scales_at, y_at;
    long long rows, cols, out_features;
    int threads;
    int allow_vnni = 1;
    if (!PyArg_ParseTuple(args, "nLLnnLni|p", &x_at, &rows, &cols, &packed_at, &scales_at, &out_features, &y_at,
                          &threads, &allow_vnni)) {
        return NULL;
    }
    if (!cpu_supported()) {
        PyErr_SetString(PyExc_RuntimeError, "the block dot-product kernels need AVX2, FMA and F16C");
        return NULL;
    }
    if (rows < 0 || cols <= 0 || cols % GROUP || out_features <= 0 || out_features % TILE || threads < 1) {
        PyErr_Format(PyExc_ValueError, "q%d x q8: bad shape rows=%lld cols=%lld out=%lld threads=%d", bits, rows,
                     cols, out_features, threads);
        return NULL;
    }
#ifdef BLOCK_DOT_X86
    const int64_t groups = cols / GROUP;
    int8_t *q = malloc((size_t)(2 * rows * cols) + 1);
    float *scale = malloc(sizeof(float) * (size_t)(2 * rows * groups) + 1);
    float *scaled_sum = malloc(sizeof(float) * (size_t)(rows * groups) + 1);
    if (!q || !scale || !scaled_sum) {
        free(q);
        free(scale);
        free(scaled_sum);
        return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS;
    quantise_rows((const float *)x_at, rows, cols, q, scale, scaled_sum, threads);
    if (bits == 4) {
        const int use_vnni = allow_vnni && rows >= VNNI_MIN_ROWS && vnni_supported();
        const int64_t pairs = use_vnni ? out_features / (2 * TILE) : 0;
        if (pairs > 0) {
            q4_product_vnni(q, scale, scaled_sum, rows, groups, (const uint8_t *)packed_at,
                            (const uint16_t *)scales_at, pairs, out_features, (float *)y_at, threads);
        }
        const int64_t done = 2 * pairs; /* tiles; the rest (all of them without VNNI) on AVX2 */
        if (done * TILE < out_features) {
            q4_product(q, scale, scaled_sum, rows, groups, (const uint8_t *)packed_at + done * groups * 128,
                       (const uint16_t *)scales_at + done * groups * 2 * TILE, out_features - done * TILE, out_features,
                       (float *)y_at + done * TILE, threads);
        }
    } else {
        q8_product(q, scale, rows, groups, (const uint8_t *)packed_at, (const uint16_t *)scales_at, out_features,
                   (float *)y_at, threads);
    }
    Py_END_ALLOW_THREADS;
    free(q);
    free(scale);
    free(scaled_sum);
#endif
    Py_RETURN_NONE;
}

static PyObject *q4_linear(PyObject *self, PyObject *args) {
    (void)self;
    return multiply(4, args);
}

static PyObject *q8_linear(PyObject *self, PyObject *args) {
    (void)self;
    return multiply(8, args);
}

static PyMethodDef methods[] = {
    {"supported", supported, METH_NOARGS, "Whether this CPU runs the kernels (AVX2, FMA and F16C)."},
    {"vnni", vnni, METH_NOARGS, "Whether q4_linear takes its AVX-512 VNNI path here (from 3 rows)."},
    {"q4_linear", q4_linear, METH_VARARGS, "y = x @ W.T, W packed q4 blocks (linear_q4q8.py); addresses as ints."},
    {"q8_linear", q8_linear, METH_VARARGS, "y = x @ W.T, W packed q8 blocks (linear_q8q8.py); addresses as ints."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_block_dot", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__block_dot(void) { return PyModule_Create(&module); }
