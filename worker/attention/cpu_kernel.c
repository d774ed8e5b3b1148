/* Paged attention for the CPU in one call per layer (worker/attention/cpu_backend.py): writes a step's
 * new keys and values into the head-major pool, then attends every query token of a ragged batch to
 * its row's keys, read in place from the row's pages.
 *
 * Why it exists: on a 2-core CPU a decode step's attention through torch (torch_backend.py) is a
 * dozen small ops per layer, ~16 ms of a ~35 ms SmolLM2 step, where its arithmetic is well under a
 * millisecond (docs/benchmarks.md, "attention in C").
 *
 * Invariants (the engine's promise: a session's tokens do not depend on its batch or its chunking):
 * - a query's output depends on its own values and its row's keys and values up to its position,
 *   nothing else: for each (query token, KV head) its scores are taken one key at a time in position
 *   order (one dot product of `dim` values in 8 float lanes summed in a fixed order), its softmax's
 *   max is exact (a NaN score is skipped: each max takes the candidate first, and maxps returns its
 *   second operand where either is NaN, so no lane's earlier scores are lost to one), its terms are
 *   summed in 8 lanes by position modulo 8, its weighted values summed in
 *   position order. Whether the keys after it are absent (a chunk) or present (the history sent
 *   whole), whatever the queries beside it in a job, the rows beside it or the thread count, the same
 *   operations run in the same order;
 * - a job is a run of one row's queries against one KV head (attend()); which queries share a job
 *   changes only the order in which the queries' independent operations interleave, and threads
 *   split the jobs only.
 *
 * Layouts: q [tokens, heads, dim] and the new k, v [tokens, kv_heads, dim], each with its own token
 * stride (heads and dim contiguous); the pool per layer [kv_heads, pool_slots, dim] (page p holds
 * slots p * page_size ...), float32 or float16 (`half`: the new keys and values rounded to nearest even
 * as they are written, each block of rows converted back to floats exactly as a job reads it, so the
 * arithmetic and its invariants are the float pool's, on the rounded values); out [tokens, heads, dim]
 * contiguous. Query head h * group + g reads KV head
 * h (GQA). Row r feeds tokens qo_indptr[r] .. qo_indptr[r + 1] - 1, the last kv_lens[r] - 1 positions
 * of its KV, in pages pages[page_indptr[r] ...]; its query j sees positions 0 .. kv_len - q_len + j.
 *
 * The int8-keys form (`int8_keys`, worker/attention/int8_kv.py; a float16 pool): the values as
 * float16, each key row as int8 with a float32 scale (its absmax / 127, the row rounded to nearest
 * even at 127 / absmax), written once. Each query head is rounded the same way to int16 (absmax /
 * 32767), per (token, head), as the job starts: int8 queries cost more agreement with the float path
 * than int8 keys (docs/benchmarks.md). Its scores are integer dot products (vpdpwssd on AVX-512
 * VNNI, vpmaddwd + vpaddd on AVX2: the same integers, exactly), each then converted and scaled in
 * one fixed order, so the invariants above hold on it as on the float forms. A key page keeps its
 * float16 slots' bytes (the host tier, copies and the prefix cache move pages whole, whatever they
 * hold): for KV head h, page p's page_size x dim float16s hold the int8 keys [dim / 2][page_size][2]
 * (key i's dims 2g, 2g + 1 at byte 2 (g page_size + i): sign-extended, one load is a register of
 * int16 pairs for 16 keys), then page_size float32 scales; the rest of the page's key bytes unused.
 * A decode reads 68 bytes of a key of 64 dims, not 128, and 16 keys' dot products run in one
 * register's lanes with no lane sums. The int8 form (`int8_values`, with the keys) holds the values so
 * too and weighs them in integers (its layout and arithmetic above int8_value_block): a decode reads
 * 136 bytes a position of a KV head, not 196.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) || defined(_M_X64)
#define CPU_KERNEL_X86 1
#include <immintrin.h>
#endif

/* The query heads one KV head serves, and the head size, at most (the job and scratch sizes). */
#define MAX_GROUP 16
#define MAX_DIM 256
/* Values of a value row weigh_rows reads at a time, four vectors of 8 per query head (so dim must be a
 * multiple of it). */
#define VALUE_PART 32
/* Positions a job reads per block (a multiple of 8): 64 keys of 64 floats are 16 KB, half an L1 cache,
 * which leaves room for the queries, scores and sums beside them (128 measured a few % slower). */
#define KEY_BLOCK 64
/* Query heads one job serves at most (a row's queries times the group; at least MAX_GROUP, one query):
 * a job reads its row's history once for all of them, so the more heads a job takes, the fewer times
 * the history is read. Where the rows are read as floats (a float32 or float16 pool: 128-256 bytes a
 * 64-dim row) 96 heads, a `tiny` chunk of 48 tokens in one job (0.89-0.95x the time of 32 with the
 * history in memory, SmolLM2 over a float16 pool 0.90x; Xeon VM; the scores' scratch grows to 3x).
 * Where they are int8 (68 bytes) 32: 96 there was 0.95-1.09x, the history no longer outweighing the
 * larger scratch (docs/benchmarks.md, "The Xeon VM again: float jobs of 96 heads"). */
#define INT8_QUERY_HEADS_PER_JOB 32
#define FLOAT_QUERY_HEADS_PER_JOB 96
#define MAX_QUERY_HEADS_PER_JOB FLOAT_QUERY_HEADS_PER_JOB
_Static_assert(INT8_QUERY_HEADS_PER_JOB >= MAX_GROUP && FLOAT_QUERY_HEADS_PER_JOB >= INT8_QUERY_HEADS_PER_JOB,
               "a job holds one query of the largest group, and the float forms' jobs at least the int8 forms'");

typedef struct {
    const float *q;
    int64_t q_stride;
    const float *k_new;
    int64_t k_stride;
    const float *v_new;
    int64_t v_stride;
    void *keys;   /* float, or float16 where `half` */
    void *values;
    int64_t pool_slots;
    int half; /* the pool holds float16 (IEEE binary16): written rounded to nearest even, read exactly */
    int int8_keys; /* (with `half`) the keys in the int8-keys form (above), the values float16 */
    int int8_values; /* (with `int8_keys`) the values in the int8-values form too */
    const int32_t *qo_indptr;
    const int32_t *kv_lens;
    const int32_t *page_indptr;
    const int32_t *pages;
    int64_t rows;
    int64_t heads;
    int64_t kv_heads;
    int64_t dim;
    int64_t page_size;
    float *out;
} Step;

#ifdef CPU_KERNEL_X86
#define AVX2 __attribute__((target("avx2,fma,f16c")))

AVX2 static inline float sum8(__m256 v) {
    __m128 low = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    low = _mm_add_ps(low, _mm_movehl_ps(low, low));
    low = _mm_add_ss(low, _mm_shuffle_ps(low, low, 1));
    return _mm_cvtss_f32(low);
}

/* Lanes 2i and 2i + 1 of each 128-bit half summed: _mm256_hadd_ps's result, as two shuffles and one
 * add (hadd is 3-4 micro-ops on the CPUs measured; the sums are the same floats). */
AVX2 static inline __m256 pair_sums(__m256 a, __m256 b) {
    return _mm256_add_ps(_mm256_shuffle_ps(a, b, 0x88), _mm256_shuffle_ps(a, b, 0xDD));
}

/* The sums of 8 vectors' lanes, as one vector: lane i is v[i]'s sum, in one fixed tree,
 * ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), whatever the other 7 vectors. */
AVX2 static inline __m256 sum8x8(const __m256 v[8]) {
    const __m256 a = pair_sums(pair_sums(v[0], v[1]), pair_sums(v[2], v[3]));
    const __m256 b = pair_sums(pair_sums(v[4], v[5]), pair_sums(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* exp for x <= 0 (Cephes' expf: 2^n times a degree-5 polynomial on the remainder, ~1 ulp). Below
 * EXP_LOWEST it returns ~1e-38 instead of the denormal: against the max term's 1 it is nothing. Its
 * constants, which exp8 and the wide path's exp16 share (the same operations on 8 or 16 lanes): */
#define EXP_LOWEST (-87.3365447505531f)
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HIGH 0.693359375f /* ln 2 in two parts, so n * ln 2 is subtracted exactly */
#define EXP_LN2_LOW (-2.12194440e-4f)
#define EXP_POLY_TERMS 6 /* the polynomial's coefficients, highest degree first */
static const float EXP_POLY[EXP_POLY_TERMS] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

AVX2 static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(EXP_LOWEST));
    __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(EXP_LOG2E), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HIGH), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LOW), x);
    __m256 y = _mm256_set1_ps(EXP_POLY[0]);
    for (int i = 1; i < EXP_POLY_TERMS; i++) {
        y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(EXP_POLY[i]));
    }
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x);
    y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
    __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(exponent));
}

/* Positions ahead of the one read whose rows a job asks the memory for (one block: a block's rows
 * are read, scored and weighed before the next block's, which gives the fetch that long). */
#define PREFETCH_ROWS KEY_BLOCK

/* Where a row's next positions live in one head's pool: a walk over its pages in position order,
 * with no division per position. A second walk runs PREFETCH_ROWS ahead of it, asking for the rows
 * it will read: a row's pages lie anywhere in the pool, and each holds a few KB, where the hardware
 * prefetcher stops (a decode step, which reads each row once, waited on its loads for half its
 * attention time). */
typedef struct {
    const int32_t *pages;
    int64_t page_size;
    int64_t page;   /* the page of the next position */
    int64_t offset; /* its slot in that page */
    int64_t ahead_page, ahead_offset; /* the next position to prefetch */
    int64_t ahead_left;               /* positions left to prefetch */
} RowCursor;

/* Asks for the cache lines of `row_bytes` at `row` (a hint: it changes no value), into the L2 cache,
 * not the L1: a block ahead is 128 lines (float16 rows) or 256 in flight, more than the L1's miss
 * buffers hold, and a prefetch into the L1 waits for one to free (measured on Zen 4: a 4-row
 * decode's attention after 5,000 positions took 42-50 ms asking for the L1, 29-33 ms asking for the
 * L2; the rows are read from the L2 a block later, when the L1 has room). */
AVX2 static inline __attribute__((always_inline)) void prefetch_row(const char *row, int64_t row_bytes) {
    for (int64_t line = 0; line < row_bytes; line += 64) {
        _mm_prefetch(row + line, _MM_HINT_T1);
    }
}

/* A cursor at position 0 of a row whose `positions` rows a job reads, with the first PREFETCH_ROWS
 * of them asked for now. */
AVX2 static inline __attribute__((always_inline)) RowCursor row_cursor(const int32_t *pages, int64_t page_size,
                                                                       int64_t positions, const void *head,
                                                                       int64_t row_bytes) {
    const int64_t first = positions < PREFETCH_ROWS ? positions : PREFETCH_ROWS;
    for (int64_t i = 0; i < first; i++) {
        prefetch_row((const char *)head + ((int64_t)pages[i / page_size] * page_size + i % page_size) * row_bytes,
                     row_bytes);
    }
    RowCursor at = {pages, page_size, 0, 0, first / page_size, first % page_size, positions - first};
    return at;
}

/* The next `count` positions' rows (`dim` values each) of the head whose pool starts at `head`: in
 * place where the pool holds floats; where it holds float16, each row converted into `converted`
 * (count x dim floats), exactly (every float16 is a float), so what follows runs the float pool's
 * arithmetic on the same values. */
AVX2 static inline __attribute__((always_inline)) void next_rows(RowCursor *at, const void *head, int half,
                                                                 int64_t dim, int64_t count, float *converted,
                                                                 const float **rows) {
    const int64_t row_bytes = dim * (half ? 2 : 4);
    for (int64_t i = 0; i < count; i++) {
        if (at->ahead_left > 0) {
            const int64_t ahead = (int64_t)at->pages[at->ahead_page] * at->page_size + at->ahead_offset;
            prefetch_row((const char *)head + ahead * row_bytes, row_bytes);
            at->ahead_left--;
            if (++at->ahead_offset == at->page_size) {
                at->ahead_offset = 0;
                at->ahead_page++;
            }
        }
        const int64_t slot = (int64_t)at->pages[at->page] * at->page_size + at->offset;
        if (half) {
            const uint16_t *from = (const uint16_t *)head + slot * dim;
            float *to = converted + i * dim;
            for (int64_t c = 0; c < dim; c += 8) {
                _mm256_storeu_ps(to + c, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(from + c))));
            }
            rows[i] = to;
        } else {
            rows[i] = (const float *)head + slot * dim;
        }
        if (++at->offset == at->page_size) {
            at->offset = 0;
            at->page++;
        }
    }
}

/* Two query heads' scores against keys block .. end - 1 of a block (`key[i]` is position block + i's
 * row; rows past the block's are zeros, up to a multiple of 8), 4 keys at a time: a key row is loaded
 * once for both heads, each key's dot product taken in 8 float lanes and the 8 dot products' lanes
 * summed in sum8x8's tree, then scaled. Returns the running max of the scores of visible keys (lanes
 * 0-3 head a's, 4-7 head b's; `limits` holds each lane's head's visible count). */
AVX2 static inline __attribute__((always_inline)) __m256 score_pair(const float *const *key, int64_t block,
                                                                    int64_t end, const float *query_a,
                                                                    const float *query_b, float *scores_a,
                                                                    float *scores_b, float scale, __m256 limits,
                                                                    int64_t all_seen, __m256 largest,
                                                                    const int64_t dim) {
    const __m256 lane_index = _mm256_setr_ps(0, 1, 2, 3, 0, 1, 2, 3);
    const __m256 unseen = _mm256_set1_ps(-INFINITY);
    for (int64_t first = block; first < end; first += 4) {
        const float *k0 = key[first - block], *k1 = key[first - block + 1];
        const float *k2 = key[first - block + 2], *k3 = key[first - block + 3];
        __m256 dot[8]; /* 0-3: head a with keys 0-3; 4-7: head b */
        __m256 qa = _mm256_loadu_ps(query_a), qb = _mm256_loadu_ps(query_b), k;
        k = _mm256_loadu_ps(k0), dot[0] = _mm256_mul_ps(qa, k), dot[4] = _mm256_mul_ps(qb, k);
        k = _mm256_loadu_ps(k1), dot[1] = _mm256_mul_ps(qa, k), dot[5] = _mm256_mul_ps(qb, k);
        k = _mm256_loadu_ps(k2), dot[2] = _mm256_mul_ps(qa, k), dot[6] = _mm256_mul_ps(qb, k);
        k = _mm256_loadu_ps(k3), dot[3] = _mm256_mul_ps(qa, k), dot[7] = _mm256_mul_ps(qb, k);
        for (int64_t c = 8; c < dim; c += 8) {
            qa = _mm256_loadu_ps(query_a + c), qb = _mm256_loadu_ps(query_b + c);
            k = _mm256_loadu_ps(k0 + c), dot[0] = _mm256_fmadd_ps(qa, k, dot[0]), dot[4] = _mm256_fmadd_ps(qb, k, dot[4]);
            k = _mm256_loadu_ps(k1 + c), dot[1] = _mm256_fmadd_ps(qa, k, dot[1]), dot[5] = _mm256_fmadd_ps(qb, k, dot[5]);
            k = _mm256_loadu_ps(k2 + c), dot[2] = _mm256_fmadd_ps(qa, k, dot[2]), dot[6] = _mm256_fmadd_ps(qb, k, dot[6]);
            k = _mm256_loadu_ps(k3 + c), dot[3] = _mm256_fmadd_ps(qa, k, dot[3]), dot[7] = _mm256_fmadd_ps(qb, k, dot[7]);
        }
        const __m256 score = _mm256_mul_ps(sum8x8(dot), _mm256_set1_ps(scale));
        _mm_storeu_ps(scores_a + first, _mm256_castps256_ps128(score));
        _mm_storeu_ps(scores_b + first, _mm256_extractf128_ps(score, 1));
        if (first + 4 <= all_seen) { /* every lane visible to its head: no mask */
            largest = _mm256_max_ps(score, largest);
        } else {
            const __m256 seen = _mm256_cmp_ps(_mm256_add_ps(_mm256_set1_ps((float)first), lane_index), limits, _CMP_LT_OQ);
            largest = _mm256_max_ps(_mm256_blendv_ps(unseen, score, seen), largest);
        }
    }
    return largest;
}

/* One query head's scores, as score_pair's, 8 keys at a time (an odd job's last head: a pair of it with
 * itself would take its dot products twice). Returns the running max over the visible keys, by lane. */
AVX2 static inline __attribute__((always_inline)) __m256 score_one(const float *const *key, int64_t block,
                                                                   int64_t end, const float *query, float *scores,
                                                                   float scale, int64_t visible, __m256 largest,
                                                                   const int64_t dim) {
    const __m256 lane_index = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t first = block; first < end; first += 8) {
        const float *const *k = key + (first - block);
        __m256 dot[8];
        const __m256 q0 = _mm256_loadu_ps(query);
        for (int64_t i = 0; i < 8; i++) {
            dot[i] = _mm256_mul_ps(q0, _mm256_loadu_ps(k[i]));
        }
        for (int64_t c = 8; c < dim; c += 8) {
            const __m256 qc = _mm256_loadu_ps(query + c);
            for (int64_t i = 0; i < 8; i++) {
                dot[i] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k[i] + c), dot[i]);
            }
        }
        const __m256 score = _mm256_mul_ps(sum8x8(dot), _mm256_set1_ps(scale));
        _mm256_storeu_ps(scores + first, score);
        const __m256 seen = _mm256_cmp_ps(_mm256_add_ps(_mm256_set1_ps((float)first), lane_index),
                                          _mm256_set1_ps((float)visible), _CMP_LT_OQ);
        largest = _mm256_max_ps(_mm256_blendv_ps(_mm256_set1_ps(-INFINITY), score, seen), largest);
    }
    return largest;
}

/* `heads` (1 or 2, a literal at the call sites) query heads' weighted values over a block's value rows
 * 0 .. rows - 1: out[h][d] += weights[h][i] * row[i][d] for each i in position order, the running sums
 * read from and written back to `sums` (a float stored and loaded is the same float), 32 dims at a
 * time, so a value row's 4 vectors serve both heads from registers. */
AVX2 static inline __attribute__((always_inline)) void weigh_rows(const float *const *row, int64_t rows,
                                                                  const float *weights_a, const float *weights_b,
                                                                  float *sums_a, float *sums_b, const int64_t heads,
                                                                  const int64_t dim) {
    for (int64_t part = 0; part < dim; part += VALUE_PART) { /* four accumulators per head below */
        __m256 a0 = _mm256_loadu_ps(sums_a + part), a1 = _mm256_loadu_ps(sums_a + part + 8);
        __m256 a2 = _mm256_loadu_ps(sums_a + part + 16), a3 = _mm256_loadu_ps(sums_a + part + 24);
        __m256 b0 = a0, b1 = a1, b2 = a2, b3 = a3;
        if (heads == 2) {
            b0 = _mm256_loadu_ps(sums_b + part), b1 = _mm256_loadu_ps(sums_b + part + 8);
            b2 = _mm256_loadu_ps(sums_b + part + 16), b3 = _mm256_loadu_ps(sums_b + part + 24);
        }
        for (int64_t i = 0; i < rows; i++) {
            const float *value = row[i] + part;
            const __m256 v0 = _mm256_loadu_ps(value), v1 = _mm256_loadu_ps(value + 8);
            const __m256 v2 = _mm256_loadu_ps(value + 16), v3 = _mm256_loadu_ps(value + 24);
            const __m256 wa = _mm256_broadcast_ss(weights_a + i);
            a0 = _mm256_fmadd_ps(wa, v0, a0), a1 = _mm256_fmadd_ps(wa, v1, a1);
            a2 = _mm256_fmadd_ps(wa, v2, a2), a3 = _mm256_fmadd_ps(wa, v3, a3);
            if (heads == 2) {
                const __m256 wb = _mm256_broadcast_ss(weights_b + i);
                b0 = _mm256_fmadd_ps(wb, v0, b0), b1 = _mm256_fmadd_ps(wb, v1, b1);
                b2 = _mm256_fmadd_ps(wb, v2, b2), b3 = _mm256_fmadd_ps(wb, v3, b3);
            }
        }
        _mm256_storeu_ps(sums_a + part, a0), _mm256_storeu_ps(sums_a + part + 8, a1);
        _mm256_storeu_ps(sums_a + part + 16, a2), _mm256_storeu_ps(sums_a + part + 24, a3);
        if (heads == 2) {
            _mm256_storeu_ps(sums_b + part, b0), _mm256_storeu_ps(sums_b + part + 8, b1);
            _mm256_storeu_ps(sums_b + part + 16, b2), _mm256_storeu_ps(sums_b + part + 24, b3);
        }
    }
}

/* The int8-keys form's rounding of one row of `dim` floats into `out` at `top` levels (127: a key as
 * it is written; 32767: a query head as a job starts); returns its scale, absmax / top. Each value is
 * rint(x * (top / absmax)), within -top .. top (a NaN value, which the max skips, 0; a row of zeros
 * all 0 with scale 0). worker/attention/int8_kv.py rounds a row the same way, to the same values. */
static float round_row(const float *row, int64_t dim, float top, int32_t *out) {
    float absmax = 0.0f;
    for (int64_t c = 0; c < dim; c++) {
        const float magnitude = fabsf(row[c]);
        absmax = magnitude > absmax ? magnitude : absmax;
    }
    const float inverse = absmax > 0.0f ? top / absmax : 0.0f;
    for (int64_t c = 0; c < dim; c++) {
        float rounded = rintf(row[c] * inverse);
        rounded = rounded > top ? top : rounded;
        rounded = rounded < -top ? -top : rounded;
        out[c] = rounded == rounded ? (int32_t)rounded : 0;
    }
    return absmax / top;
}

#define ROW_LEVELS 127.0f /* a key or value row's levels */
#define QUERY_LEVELS 32767.0f

/* Where an int8 page puts a row's bytes: a key page pairs a key's dims ([dim / 2][page_size][2], the
 * header), a value page two positions' rows ([page_size / 2][dim][2], the int8-values form below). */
typedef enum { INT8_KEY_LAYOUT, INT8_VALUE_LAYOUT } Int8Layout;

/* Writes `row` (dim floats) as slot `i` of the int8 page whose bytes start at `page`: rounded at
 * ROW_LEVELS, its bytes where `layout` puts them, its scale after the page's page_size x dim bytes. */
static void store_int8_row(uint8_t *page, int64_t page_size, int64_t i, const float *row, int64_t dim,
                           Int8Layout layout) {
    int32_t rounded[MAX_DIM];
    const float scale = round_row(row, dim, ROW_LEVELS, rounded);
    for (int64_t c = 0; c < dim; c++) {
        const int64_t at = layout == INT8_KEY_LAYOUT ? ((c / 2) * page_size + i) * 2 + c % 2
                                                     : ((i / 2) * dim + c) * 2 + i % 2;
        page[at] = (uint8_t)(int8_t)rounded[c];
    }
    memcpy(page + page_size * dim + 4 * i, &scale, sizeof scale);
}

/* A job's query heads for the int8 keys: each head's int16 values in pairs (dims 2g, 2g + 1 in one
 * 32-bit word, the low one first, as a key register's pairs), stored pair by pair, so the heads that
 * share a key register read one run of words (`pairs[g][head]`), and `factor` = its scale / sqrt(dim): a
 * score is (float)dot x key scale x factor. A dot product is at most MAX_DIM x 32767 x 127 (~1.07e9)
 * in magnitude: no int32 lane overflows. */
typedef struct {
    int32_t pairs[MAX_DIM / 2][INT8_QUERY_HEADS_PER_JOB];
    float factor[INT8_QUERY_HEADS_PER_JOB];
} KeyQueries;

static void round_queries(const float *const *heads, int64_t count, int64_t dim, float softmax_scale,
                          KeyQueries *out) {
    for (int64_t qg = 0; qg < count; qg++) {
        int32_t rounded[MAX_DIM];
        const float scale = round_row(heads[qg], dim, QUERY_LEVELS, rounded);
        for (int64_t g = 0; g < dim / 2; g++) {
            out->pairs[g][qg] = (int32_t)(((uint32_t)(uint16_t)rounded[2 * g + 1] << 16) | (uint16_t)rounded[2 * g]);
        }
        out->factor[qg] = scale * softmax_scale;
    }
}

/* Pages ahead of the one scored whose int8 keys a job asks the memory for (64 positions of 16-key pages,
 * as the float walk's block). */
#define INT8_PREFETCH_PAGES 4

/* Asks for the key bytes of the row's page `index` (its int8 keys and scales) into the L2 cache. */
AVX2 static inline __attribute__((always_inline)) void prefetch_int8_page(const uint8_t *head_keys,
                                                                          const int32_t *row_pages, int64_t index,
                                                                          int64_t page_size, int64_t dim) {
    const uint8_t *page = head_keys + (int64_t)row_pages[index] * page_size * dim * 2;
    prefetch_row((const char *)page, page_size * (dim + 4));
}

/* `n` (at most 4) query heads' scores against 8 int8 keys, slots k0 .. k0 + 7 of `page` (positions
 * first ..): per pair of dims, the keys sign-extended to int16 and multiplied by the query's pair, the
 * two products summed (vpmaddwd), exactly: the integer dot products. Stored at position `first` of
 * each head's scores, its running max (8 lanes) over the visible ones. */
AVX2 static inline __attribute__((always_inline)) void score_int8_eight(const uint8_t *page, int64_t page_size,
                                                                        int64_t k0, int64_t first,
                                                                        const KeyQueries *queries, int64_t h0,
                                                                        float *const *scores,
                                                                        const int64_t *visible, __m256 *largest,
                                                                        const int n, const int64_t dim) {
    __m256i acc[4];
#pragma GCC unroll 4
    for (int j = 0; j < n; j++) {
        acc[j] = _mm256_setzero_si256();
    }
#pragma GCC unroll 4
    for (int64_t g = 0; g < dim / 2; g++) {
        const __m256i key =
            _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(page + (g * page_size + k0) * 2)));
#pragma GCC unroll 4
        for (int j = 0; j < n; j++) {
            acc[j] = _mm256_add_epi32(acc[j], _mm256_madd_epi16(key, _mm256_set1_epi32(queries->pairs[g][h0 + j])));
        }
    }
    const __m256 key_scale = _mm256_loadu_ps((const float *)(page + page_size * dim) + k0);
    for (int j = 0; j < n; j++) {
        const __m256 score = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(acc[j]), key_scale),
                                           _mm256_set1_ps(queries->factor[h0 + j]));
        _mm256_storeu_ps(scores[h0 + j] + first, score);
        if (first + 8 <= visible[h0 + j]) {
            largest[h0 + j] = _mm256_max_ps(score, largest[h0 + j]);
        } else {
            const __m256 seen = _mm256_cmp_ps(_mm256_add_ps(_mm256_set1_ps((float)first),
                                                            _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7)),
                                              _mm256_set1_ps((float)visible[h0 + j]), _CMP_LT_OQ);
            largest[h0 + j] = _mm256_max_ps(_mm256_blendv_ps(_mm256_set1_ps(-INFINITY), score, seen), largest[h0 + j]);
        }
    }
}

/* The largest of 8 lanes (exact in any order). */
AVX2 static inline float max8(__m256 v) {
    float lanes[8];
    _mm256_storeu_ps(lanes, v);
    float largest = lanes[0];
    for (int i = 1; i < 8; i++) {
        largest = lanes[i] > largest ? lanes[i] : largest;
    }
    return largest;
}

/* The int8-values form (`int8_values`, with the int8 keys): each value row as int8 with a float32
 * scale (absmax / 127), written once like a key; a value page's float16 slots hold, for KV head h and
 * page p, the int8 values [page_size / 2][dim][2] (positions 2i, 2i + 1 of dim c at byte 2 (i dim + c)
 * and the next: sign-extended, one load is a register of int16 pairs, two positions of 16 dims), then
 * page_size float32 scales. A job weighs a block's rows in integers: each head's weights over the block
 * (softmax term x the row's scale) rounded to int16, WEIGHT_LEVELS for its largest weight there
 * (round_weights), the integer sums of weight x value exact (vpdpwssd, or vpmaddwd + vpaddd: the same
 * integers), then each sum added to the head's float sum once a block, as (float)sum x unit (one fused
 * multiply-add). A block's integers depend on its rows and the head's terms only, so the header's
 * invariants hold. The sums stay within int32: 32 pairs x 2 x 32767 x 127 is ~2.7e8. */
#define WEIGHT_LEVELS 32767

/* A block's int8 value rows: where each pair of positions' bytes start, and each row's scale. */
typedef struct {
    const uint8_t *pair[KEY_BLOCK / 2];
    float scale[KEY_BLOCK];
} Int8ValueBlock;

/* One head's weights over a block: rows 2p and 2p + 1's int16 levels in pairs[p] (the first in the low
 * half, as a value register's pairs), and `unit`, a level's weight (0 where the block adds nothing). */
typedef struct {
    int32_t pairs[KEY_BLOCK / 2];
    float unit;
} Int8Weights;

/* The block of `rows` positions from `block` (a multiple of KEY_BLOCK), 16 positions of one page at a
 * time (page_size is a multiple of 16). */
static void int8_value_block(const uint8_t *head_values, const int32_t *row_pages, int64_t page_size, int64_t dim,
                             int64_t block, int64_t rows, Int8ValueBlock *out) {
    for (int64_t i = 0; i < rows; i += 16) {
        const int64_t position = block + i, offset = position % page_size;
        const uint8_t *page = head_values + (int64_t)row_pages[position / page_size] * page_size * dim * 2;
        for (int64_t pair = 0; pair < 8; pair++) {
            out->pair[i / 2 + pair] = page + (offset + 2 * pair) * dim;
        }
        memcpy(out->scale + i, page + page_size * dim + 4 * offset, sizeof(float) * (rows - i < 16 ? rows - i : 16));
    }
}

/* Asks for the int8 value bytes and scales of positions from .. to - 1 (within the row) into the L2. */
AVX2 static inline __attribute__((always_inline)) void prefetch_int8_values(const uint8_t *head_values,
                                                                            const int32_t *row_pages,
                                                                            int64_t page_size, int64_t dim,
                                                                            int64_t from, int64_t to) {
    for (int64_t position = from; position < to; position += 16) {
        const int64_t offset = position % page_size;
        const uint8_t *page = head_values + (int64_t)row_pages[position / page_size] * page_size * dim * 2;
        prefetch_row((const char *)(page + offset * dim), 16 * dim);
        _mm_prefetch((const char *)(page + page_size * dim + 4 * offset), _MM_HINT_T1);
    }
}

/* The block's pairs of rows `from` .. `to` - 1 sign-extended to int16 (pair p's 2 dim values at
 * out + 2 p dim, in the page's order; a pair's bytes hold both its rows, so a pair is extended whole
 * even where a query sees only its first row), once a block: every pair of heads weighing it on the
 * AVX2 path then loads them as they are, where extending them per pair of heads took as many
 * instructions as the multiplies (256 bytes a pair of 64-dim rows, 8 KB a block: it stays in the L1). */
AVX2 static void extend_int8_values(const Int8ValueBlock *block, int64_t from, int64_t to, int64_t dim,
                                    int16_t *out) {
    for (int64_t p = from; p < to; p++) {
        for (int64_t c = 0; c < 2 * dim; c += 16) {
            _mm256_storeu_si256((__m256i *)(out + 2 * p * dim + c),
                                _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(block->pair[p] + c))));
        }
    }
}

/* A head's weight levels over the block's first `rows` rows, from its softmax terms there (`terms`;
 * lanes past `rows` ignored) and the rows' scales: a weight is term x scale, and its level
 * rint(weight x (WEIGHT_LEVELS / top)) within 0 .. WEIGHT_LEVELS, `top` the head's largest weight in
 * the block (a NaN weight, which the max skips, level 0), so a level's error is at most half of
 * top / WEIGHT_LEVELS: relative to what the block adds at most, whatever one row's scale
 * (round_weights_wide takes the same steps on 16 lanes). */
AVX2 static inline __attribute__((always_inline)) void round_weights(const float *terms, const float *scales,
                                                                     int64_t rows, Int8Weights *out) {
    __m256 weight[KEY_BLOCK / 8];
    __m256 largest = _mm256_setzero_ps();
    const __m256 lane_index = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    const int64_t vectors = (rows + 7) / 8;
    for (int64_t v = 0; v < vectors; v++) {
        __m256 w = _mm256_mul_ps(_mm256_loadu_ps(terms + 8 * v), _mm256_loadu_ps(scales + 8 * v));
        if (8 * v + 8 > rows) {
            w = _mm256_and_ps(w, _mm256_cmp_ps(_mm256_add_ps(_mm256_set1_ps((float)(8 * v)), lane_index),
                                               _mm256_set1_ps((float)rows), _CMP_LT_OQ));
        }
        weight[v] = w;
        largest = _mm256_max_ps(w, largest); /* a NaN lane keeps `largest` */
    }
    const float top = max8(largest);
    const __m256 inverse = _mm256_set1_ps(top > 0.0f ? (float)WEIGHT_LEVELS / top : 0.0f);
    for (int64_t v = 0; v < vectors; v += 2) {
        __m256i levels[2];
        for (int64_t k = 0; k < 2; k++) {
            /* nearest even (NaN: INT_MIN, so 0) */
            const __m256i level = v + k < vectors ? _mm256_cvtps_epi32(_mm256_mul_ps(weight[v + k], inverse))
                                                  : _mm256_setzero_si256();
            levels[k] = _mm256_min_epi32(_mm256_max_epi32(level, _mm256_setzero_si256()),
                                         _mm256_set1_epi32(WEIGHT_LEVELS));
        }
        /* 16 levels as uint16 in position order: the pairs of rows 8v .. 8v + 15 */
        const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(levels[0], levels[1]), 0xD8);
        _mm256_storeu_si256((__m256i *)(out->pairs + 4 * v), packed);
    }
    out->unit = top / (float)WEIGHT_LEVELS;
}

/* Heads of an int8 value block weighed together on the AVX2 path: a pair's 4 registers (32 dims) loaded
 * once serve both, in 8 accumulators (3 heads in 12 measured slower on Zen 3: 16 registers in all). */
#define AVX2_INT8_WEIGH_HEADS 2
_Static_assert(AVX2_INT8_WEIGH_HEADS == 2, "attend's call sites instantiate weigh_int8_rows for 1 and 2 heads");

/* `heads` (at most AVX2_INT8_WEIGH_HEADS) heads' weighted values over a block's `pairs` pairs of rows,
 * as int16 (extend_int8_values), 32 dims a pass: each lane's integer sum exact, then added to the
 * head's float sums once (the fused multiply-add weigh_int8_tile's lanes take). */
AVX2 static inline __attribute__((always_inline)) void weigh_int8_rows(const int16_t *extended, int64_t pairs,
                                                                       const Int8Weights *weights,
                                                                       float *const *sums, const int heads,
                                                                       const int64_t dim) {
    for (int64_t part = 0; part < dim; part += VALUE_PART) {
        __m256i acc[AVX2_INT8_WEIGH_HEADS][4];
        for (int j = 0; j < heads; j++) {
            for (int c = 0; c < 4; c++) {
                acc[j][c] = _mm256_setzero_si256();
            }
        }
#pragma GCC unroll 2
        for (int64_t p = 0; p < pairs; p++) {
            const int16_t *pair_values = extended + p * dim * 2 + part * 2;
            for (int c = 0; c < 4; c++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(pair_values + 16 * c));
                for (int j = 0; j < heads; j++) {
                    acc[j][c] = _mm256_add_epi32(acc[j][c], _mm256_madd_epi16(v, _mm256_set1_epi32(weights[j].pairs[p])));
                }
            }
        }
        for (int j = 0; j < heads; j++) {
            for (int c = 0; c < 4; c++) {
                float *sum = sums[j] + part + 8 * c;
                _mm256_storeu_ps(sum, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[j][c]), _mm256_set1_ps(weights[j].unit),
                                                      _mm256_loadu_ps(sum)));
            }
        }
    }
}

/* Every job head's scores against the row's first `positions` keys in the int8-keys form, a page at a
 * time in position order (scores[qg] written to `positions` rounded up to 8), and each head's max over
 * its visible keys into `head_largest`. */
AVX2 static void score_int8_row(const uint8_t *head_keys, const int32_t *row_pages, int64_t page_size,
                                int64_t positions, const KeyQueries *queries, int64_t heads,
                                float *const *scores, const int64_t *visible, float *head_largest,
                                const int64_t dim) {
    __m256 largest[INT8_QUERY_HEADS_PER_JOB];
    for (int64_t qg = 0; qg < heads; qg++) {
        largest[qg] = _mm256_set1_ps(-INFINITY);
    }
    const int64_t pages = (positions + page_size - 1) / page_size;
    for (int64_t index = 0; index < INT8_PREFETCH_PAGES && index < pages; index++) {
        prefetch_int8_page(head_keys, row_pages, index, page_size, dim);
    }
    for (int64_t index = 0; index < pages; index++) {
        if (index + INT8_PREFETCH_PAGES < pages) {
            prefetch_int8_page(head_keys, row_pages, index + INT8_PREFETCH_PAGES, page_size, dim);
        }
        const uint8_t *page = head_keys + (int64_t)row_pages[index] * page_size * dim * 2;
        for (int64_t k0 = 0; k0 < page_size && index * page_size + k0 < positions; k0 += 8) {
            for (int64_t h0 = 0; h0 < heads; h0 += 4) {
                const int64_t first = index * page_size + k0;
                switch (heads - h0 < 4 ? heads - h0 : 4) {
                case 1: score_int8_eight(page, page_size, k0, first, queries, h0, scores, visible, largest, 1, dim); break;
                case 2: score_int8_eight(page, page_size, k0, first, queries, h0, scores, visible, largest, 2, dim); break;
                case 3: score_int8_eight(page, page_size, k0, first, queries, h0, scores, visible, largest, 3, dim); break;
                default: score_int8_eight(page, page_size, k0, first, queries, h0, scores, visible, largest, 4, dim); break;
                }
            }
        }
    }
    for (int64_t qg = 0; qg < heads; qg++) {
        head_largest[qg] = max8(largest[qg]);
    }
}

/* The same arithmetic on AVX-512 (a CPU with AVX-512F, chosen at run time: `wide`), every float lane
 * computing what the AVX2 code's lane computes, in the same order, so a query's output is the same
 * bits on either (a session copied between two workers continues as it would have on either;
 * tests/worker/test_cpu_attention.py). ~1.6x on a micro-turn's append on Zen 5 (docs/benchmarks.md,
 * "AVX-512 VNNI for the appends"). Not inlined into `attend` (a function cannot inline code built for
 * an instruction set it is not built for): one call per block and pair of heads. */
#define WIDE __attribute__((target("avx512f,avx512dq,avx2,fma,f16c"), noinline))

/* Code for the wide path that its WIDE functions inline. */
#define WIDE_INLINE __attribute__((target("avx512f,avx512dq,avx2,fma,f16c"), always_inline)) static inline

/* Four keys' scores for a pair of query heads from their dot products d[0..3] (a register per key: head
 * a's 8 lanes in its low half, head b's in its high half), stored at position `at` of each head's
 * scores, and the running max (lanes 0-3 head a's, 4-7 head b's) over the visible ones. The tree sums
 * each half's lanes exactly as sum8x8 does: the in-lane shuffles per 128 bits, the last step's halves
 * placed by shuffle_f32x4. */
WIDE_INLINE __m256 four_scores(const __m512 d[4], int64_t at, float *scores_a, float *scores_b, float scale,
                               __m256 limits, int64_t all_seen, __m256 largest) {
    /* pair_sums per 128-bit lane: halves [a | b] of sum8x8's a = tree(v0..v3), b = tree(v4..v7) */
    const __m512 p01 = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
    const __m512 p23 = _mm512_add_ps(_mm512_shuffle_ps(d[2], d[3], 0x88), _mm512_shuffle_ps(d[2], d[3], 0xDD));
    const __m512 p = _mm512_add_ps(_mm512_shuffle_ps(p01, p23, 0x88), _mm512_shuffle_ps(p01, p23, 0xDD));
    /* [a.lo + a.hi, b.lo + b.hi], sum8x8's last step */
    const __m512 even = _mm512_shuffle_f32x4(p, p, _MM_SHUFFLE(2, 0, 2, 0));
    const __m512 odd = _mm512_shuffle_f32x4(p, p, _MM_SHUFFLE(3, 1, 3, 1));
    const __m256 score = _mm256_mul_ps(_mm512_castps512_ps256(_mm512_add_ps(even, odd)), _mm256_set1_ps(scale));
    _mm_storeu_ps(scores_a + at, _mm256_castps256_ps128(score));
    _mm_storeu_ps(scores_b + at, _mm256_extractf128_ps(score, 1));
    if (at + 4 <= all_seen) { /* every lane visible to its head: no mask */
        return _mm256_max_ps(score, largest);
    }
    const __m256 seen = _mm256_cmp_ps(_mm256_add_ps(_mm256_set1_ps((float)at), _mm256_setr_ps(0, 1, 2, 3, 0, 1, 2, 3)),
                                      limits, _CMP_LT_OQ);
    return _mm256_max_ps(_mm256_blendv_ps(_mm256_set1_ps(-INFINITY), score, seen), largest);
}

/* score_pair's scores: a register holds head a's 8 lanes of a key's dot product in its low half and
 * head b's in its high half (the key row broadcast to both, the two queries side by side), so one FMA
 * does the two of score_pair's; four_scores then sums each key's lanes. */
WIDE static __m256 score_pair_wide(const float *const *key, int64_t block, int64_t end, const float *query_a,
                                   const float *query_b, float *scores_a, float *scores_b, float scale,
                                   __m256 limits, int64_t all_seen, __m256 largest, const int64_t dim) {
    __m512 query[MAX_DIM / 8];
    for (int64_t c = 0; c < dim; c += 8) {
        query[c / 8] = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(query_a + c)),
                                          _mm256_loadu_ps(query_b + c), 1);
    }
    /* 8 keys a pass (block and end are multiples of 8 apart), so 8 FMA chains run at once; each group
     * of 4 is then summed and stored as one of score_pair's passes. */
    for (int64_t first = block; first < end; first += 8) {
        const float *const *k = key + (first - block);
        __m512 dot[8];
        for (int i = 0; i < 8; i++) {
            dot[i] = _mm512_mul_ps(query[0], _mm512_broadcast_f32x8(_mm256_loadu_ps(k[i])));
        }
        for (int64_t c = 8; c < dim; c += 8) {
            const __m512 q = query[c / 8];
            for (int i = 0; i < 8; i++) {
                dot[i] = _mm512_fmadd_ps(q, _mm512_broadcast_f32x8(_mm256_loadu_ps(k[i] + c)), dot[i]);
            }
        }
        largest = four_scores(dot, first, scores_a, scores_b, scale, limits, all_seen, largest);
        largest = four_scores(dot + 4, first + 4, scores_a, scores_b, scale, limits, all_seen, largest);
    }
    return largest;
}

/* Two pairs of query heads' scores (heads[0], heads[1] and heads[2], heads[3]), as score_pair_wide's,
 * 4 keys a pass: a key's broadcast serves both pairs (8 FMA chains, the two pairs' queries in 16
 * registers for dim 64). `end` is the second pair's (a later query's, so the first pair's scores past
 * its own end are taken too: written within its stride, out of its max). */
WIDE static void score_quad_wide(const float *const *key, int64_t block, int64_t end, const float *const *heads,
                                 float *const *scores, float scale, const __m256 *limits, const int64_t *all_seen,
                                 __m256 *largest, const int64_t dim) {
    __m512 query[2][MAX_DIM / 8];
    for (int pair = 0; pair < 2; pair++) {
        for (int64_t c = 0; c < dim; c += 8) {
            query[pair][c / 8] = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(heads[2 * pair] + c)),
                                                    _mm256_loadu_ps(heads[2 * pair + 1] + c), 1);
        }
    }
    __m256 largest_a = largest[0], largest_b = largest[1];
    for (int64_t first = block; first < end; first += 4) {
        const float *const *k = key + (first - block);
        __m512 dot_a[4], dot_b[4];
        for (int i = 0; i < 4; i++) {
            const __m512 row = _mm512_broadcast_f32x8(_mm256_loadu_ps(k[i]));
            dot_a[i] = _mm512_mul_ps(query[0][0], row);
            dot_b[i] = _mm512_mul_ps(query[1][0], row);
        }
        for (int64_t c = 8; c < dim; c += 8) {
            for (int i = 0; i < 4; i++) {
                const __m512 row = _mm512_broadcast_f32x8(_mm256_loadu_ps(k[i] + c));
                dot_a[i] = _mm512_fmadd_ps(query[0][c / 8], row, dot_a[i]);
                dot_b[i] = _mm512_fmadd_ps(query[1][c / 8], row, dot_b[i]);
            }
        }
        largest_a = four_scores(dot_a, first, scores[0], scores[1], scale, limits[0], all_seen[0], largest_a);
        largest_b = four_scores(dot_b, first, scores[2], scores[3], scale, limits[1], all_seen[1], largest_b);
    }
    largest[0] = largest_a;
    largest[1] = largest_b;
}

/* The int8-keys scores on AVX-512 VNNI (a CPU with it, chosen at run time): score_int8_row's integers
 * and float operations, 16 keys a register: per pair of dims the keys sign-extended to int16 pairs and
 * vpdpwssd adds each key's two products to its lane, so after dim / 2 of them a lane holds the key's
 * exact dot product, as AVX2's does; the scaling and the max are the same operations. */
#define WIDE_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni,avx512dq,avx2,fma,f16c"), noinline))
#define WIDE_VNNI_INLINE \
    __attribute__((target("avx512f,avx512bw,avx512vnni,avx512dq,avx2,fma,f16c"), always_inline)) static inline

/* Heads score_int8_sixteen takes at once: a key register serves 8 accumulators. */
#define INT8_HEADS 8

WIDE_VNNI_INLINE void score_int8_sixteen(const uint8_t *page, int64_t page_size, int64_t k0, int64_t first,
                                         const KeyQueries *queries, int64_t h0, float *const *scores,
                                         const int64_t *visible, __m512 *largest, const int n,
                                         const int64_t dim) {
    __m512i acc[INT8_HEADS];
#pragma GCC unroll 8
    for (int j = 0; j < n; j++) {
        acc[j] = _mm512_setzero_si512();
    }
#pragma GCC unroll 8
    for (int64_t g = 0; g < dim / 2; g++) {
        const __m512i key =
            _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(page + (g * page_size + k0) * 2)));
#pragma GCC unroll 8
        for (int j = 0; j < n; j++) {
            acc[j] = _mm512_dpwssd_epi32(acc[j], key, _mm512_set1_epi32(queries->pairs[g][h0 + j]));
        }
    }
    const __m512 key_scale = _mm512_loadu_ps((const float *)(page + page_size * dim) + k0);
    const __m512i lane_index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#pragma GCC unroll 8
    for (int j = 0; j < n; j++) {
        const __m512 score = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(acc[j]), key_scale),
                                           _mm512_set1_ps(queries->factor[h0 + j]));
        _mm512_storeu_ps(scores[h0 + j] + first, score);
        if (first + 16 <= visible[h0 + j]) {
            largest[j] = _mm512_max_ps(score, largest[j]);
        } else {
            const __mmask16 seen = _mm512_cmplt_epi32_mask(
                _mm512_add_epi32(_mm512_set1_epi32((int)first), lane_index), _mm512_set1_epi32((int)visible[h0 + j]));
            largest[j] = _mm512_mask_max_ps(largest[j], seen, score, largest[j]);
        }
    }
}

/* score_int8_row on AVX-512 VNNI (page_size a multiple of 16): per 16 keys, the heads INT8_HEADS at a
 * time, so a page read from memory serves every head of the job from the L1. */
WIDE_VNNI static void score_int8_row_wide(const uint8_t *head_keys, const int32_t *row_pages, int64_t page_size,
                                          int64_t positions, const KeyQueries *queries, int64_t heads,
                                          float *const *scores, const int64_t *visible, float *head_largest,
                                          const int64_t dim) {
    __m512 largest[INT8_QUERY_HEADS_PER_JOB];
    for (int64_t qg = 0; qg < heads; qg++) {
        largest[qg] = _mm512_set1_ps(-INFINITY);
    }
    const int64_t pages = (positions + page_size - 1) / page_size;
    for (int64_t index = 0; index < INT8_PREFETCH_PAGES && index < pages; index++) {
        prefetch_int8_page(head_keys, row_pages, index, page_size, dim);
    }
    for (int64_t index = 0; index < pages; index++) {
        if (index + INT8_PREFETCH_PAGES < pages) {
            prefetch_int8_page(head_keys, row_pages, index + INT8_PREFETCH_PAGES, page_size, dim);
        }
        const uint8_t *page = head_keys + (int64_t)row_pages[index] * page_size * dim * 2;
        for (int64_t k0 = 0; k0 < page_size && index * page_size + k0 < positions; k0 += 16) {
            const int64_t first = index * page_size + k0;
            for (int64_t h0 = 0; h0 < heads; h0 += INT8_HEADS) {
                __m512 *group_largest = largest + h0;
                switch (heads - h0 < INT8_HEADS ? heads - h0 : INT8_HEADS) {
                case 1: score_int8_sixteen(page, page_size, k0, first, queries, h0, scores, visible, group_largest, 1, dim); break;
                case 2: score_int8_sixteen(page, page_size, k0, first, queries, h0, scores, visible, group_largest, 2, dim); break;
                case 3: score_int8_sixteen(page, page_size, k0, first, queries, h0, scores, visible, group_largest, 3, dim); break;
                case 4: score_int8_sixteen(page, page_size, k0, first, queries, h0, scores, visible, group_largest, 4, dim); break;
                case 5: score_int8_sixteen(page, page_size, k0, first, queries, h0, scores, visible, group_largest, 5, dim); break;
                case 6: score_int8_sixteen(page, page_size, k0, first, queries, h0, scores, visible, group_largest, 6, dim); break;
                case 7: score_int8_sixteen(page, page_size, k0, first, queries, h0, scores, visible, group_largest, 7, dim); break;
                default: score_int8_sixteen(page, page_size, k0, first, queries, h0, scores, visible, group_largest, 8, dim); break;
                }
            }
        }
    }
    for (int64_t qg = 0; qg < heads; qg++) {
        head_largest[qg] = _mm512_reduce_max_ps(largest[qg]);
    }
}

/* Heads weigh_heads_wide takes per pass of a value row: 24 accumulators and the row's 4 vectors, where
 * two heads a pass (8 FMA chains, and a group of 3's odd head alone with 4) left the FMA units idle
 * half the time on Zen 5. */
#define WEIGH_HEADS 6

/* weigh_rows on AVX-512 for `heads` heads (at most WEIGH_HEADS) at once, each with its own weights and
 * sums, 16 dims a register and 64 a pass where they are there (else 32): a value row's vectors serve
 * every head from registers. Each output lane's FMAs are weigh_rows', in position order. */
WIDE_INLINE void weigh_tile(const float *const *row, int64_t rows, const float *const *weights, float *const *sums,
                            const int heads, const int64_t dim) {
    for (int64_t part = 0; part < dim;) {
        const int vectors = part + 64 <= dim ? 4 : 2; /* dim is a multiple of 32 */
        __m512 acc[WEIGH_HEADS][4];
#pragma GCC unroll 16
        for (int g = 0; g < heads; g++) {
#pragma GCC unroll 16
            for (int c = 0; c < vectors; c++) {
                acc[g][c] = _mm512_loadu_ps(sums[g] + part + 16 * c);
            }
        }
#pragma GCC unroll 4
        for (int64_t i = 0; i < rows; i++) {
            const float *value = row[i] + part;
            __m512 v[4];
#pragma GCC unroll 16
            for (int c = 0; c < vectors; c++) {
                v[c] = _mm512_loadu_ps(value + 16 * c);
            }
#pragma GCC unroll 16
            for (int g = 0; g < heads; g++) {
                const __m512 w = _mm512_set1_ps(weights[g][i]);
#pragma GCC unroll 16
                for (int c = 0; c < vectors; c++) {
                    acc[g][c] = _mm512_fmadd_ps(w, v[c], acc[g][c]);
                }
            }
        }
#pragma GCC unroll 16
        for (int g = 0; g < heads; g++) {
#pragma GCC unroll 16
            for (int c = 0; c < vectors; c++) {
                _mm512_storeu_ps(sums[g] + part + 16 * c, acc[g][c]);
            }
        }
        part += 16 * vectors;
    }
}

WIDE_INLINE void weigh_heads_dim(const float *const *row, int64_t rows, const float *const *weights,
                                 float *const *sums, int64_t heads, const int64_t dim) {
    for (int64_t first = 0; first < heads; first += WEIGH_HEADS) {
        const float *const *w = weights + first;
        float *const *s = sums + first;
        switch (heads - first < WEIGH_HEADS ? heads - first : WEIGH_HEADS) {
        case 1: weigh_tile(row, rows, w, s, 1, dim); break;
        case 2: weigh_tile(row, rows, w, s, 2, dim); break;
        case 3: weigh_tile(row, rows, w, s, 3, dim); break;
        case 4: weigh_tile(row, rows, w, s, 4, dim); break;
        case 5: weigh_tile(row, rows, w, s, 5, dim); break;
        default: weigh_tile(row, rows, w, s, 6, dim); break;
        }
    }
}

/* The weighted values of `heads` heads that see the same `rows` rows of a block (weights[g][i], sums[g]),
 * WEIGH_HEADS at a time. */
WIDE static void weigh_heads_wide(const float *const *row, int64_t rows, const float *const *weights,
                                  float *const *sums, int64_t heads, int64_t dim) {
    if (dim == 64) {
        weigh_heads_dim(row, rows, weights, sums, heads, 64);
    } else {
        weigh_heads_dim(row, rows, weights, sums, heads, dim);
    }
}

/* Heads weigh_int8_tile takes per pass of a pair of rows: 16 accumulators, the pair's 4 registers and a
 * weight's broadcast. Six, as weigh_tile's, left gcc moving accumulators between registers around
 * vpdpwssd (which adds into its destination) and spilling them: 0.8x the appends' time with four. */
#define INT8_WEIGH_HEADS 4

/* weigh_int8_rows on AVX-512 VNNI for `heads` heads (at most INT8_WEIGH_HEADS) at once, 16 dims a
 * register and 64 a pass where they are there (else 32): a pair's registers serve every head; each
 * lane's integers and its one fused multiply-add are weigh_int8_rows'. */
WIDE_VNNI_INLINE void weigh_int8_tile(const Int8ValueBlock *block, int64_t pairs, const Int8Weights *const *weights,
                                      float *const *sums, const int heads, const int64_t dim) {
    for (int64_t part = 0; part < dim;) {
        const int vectors = part + 64 <= dim ? 4 : 2; /* dim is a multiple of 32 */
        __m512i acc[INT8_WEIGH_HEADS][4];
#pragma GCC unroll 16
        for (int g = 0; g < heads; g++) {
#pragma GCC unroll 16
            for (int c = 0; c < vectors; c++) {
                acc[g][c] = _mm512_setzero_si512();
            }
        }
#pragma GCC unroll 2
        for (int64_t p = 0; p < pairs; p++) {
            const uint8_t *bytes = block->pair[p] + part * 2;
            __m512i v[4];
#pragma GCC unroll 16
            for (int c = 0; c < vectors; c++) {
                v[c] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(bytes + 32 * c)));
            }
#pragma GCC unroll 16
            for (int g = 0; g < heads; g++) {
                const __m512i w = _mm512_set1_epi32(weights[g]->pairs[p]);
#pragma GCC unroll 16
                for (int c = 0; c < vectors; c++) {
                    acc[g][c] = _mm512_dpwssd_epi32(acc[g][c], v[c], w);
                }
            }
        }
#pragma GCC unroll 16
        for (int g = 0; g < heads; g++) {
            const __m512 unit = _mm512_set1_ps(weights[g]->unit);
#pragma GCC unroll 16
            for (int c = 0; c < vectors; c++) {
                float *sum = sums[g] + part + 16 * c;
                _mm512_storeu_ps(sum, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[g][c]), unit, _mm512_loadu_ps(sum)));
            }
        }
        part += 16 * vectors;
    }
}

/* round_weights on 16 lanes: each lane's operations are round_weights' (the max exact in any order), so
 * the levels are the same integers. */
WIDE_VNNI_INLINE void round_weights_wide(const float *terms, const float *scales, int64_t rows, Int8Weights *out) {
    __m512 weight[KEY_BLOCK / 16];
    __m512 largest = _mm512_setzero_ps();
    const int64_t vectors = (rows + 15) / 16;
    for (int64_t v = 0; v < vectors; v++) {
        const __mmask16 seen = rows - 16 * v >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (rows - 16 * v)) - 1);
        const __m512 w = _mm512_maskz_mul_ps(seen, _mm512_loadu_ps(terms + 16 * v), _mm512_loadu_ps(scales + 16 * v));
        weight[v] = w;
        largest = _mm512_max_ps(w, largest); /* a NaN lane keeps `largest` */
    }
    const float top = _mm512_reduce_max_ps(largest);
    const __m512 inverse = _mm512_set1_ps(top > 0.0f ? (float)WEIGHT_LEVELS / top : 0.0f);
    for (int64_t v = 0; v < vectors; v++) {
        const __m512i level = _mm512_cvtps_epi32(_mm512_mul_ps(weight[v], inverse)); /* NaN: INT_MIN, so 0 */
        const __m512i clamped = _mm512_min_epi32(_mm512_max_epi32(level, _mm512_setzero_si512()),
                                                 _mm512_set1_epi32(WEIGHT_LEVELS));
        _mm256_storeu_si256((__m256i *)(out->pairs + 8 * v), _mm512_cvtepi32_epi16(clamped));
    }
    out->unit = top / (float)WEIGHT_LEVELS;
}

WIDE_VNNI_INLINE void weigh_int8_dim(const Int8ValueBlock *block, int64_t pairs, const Int8Weights *const *weights,
                                     float *const *sums, int64_t heads, const int64_t dim) {
    for (int64_t first = 0; first < heads; first += INT8_WEIGH_HEADS) {
        const Int8Weights *const *w = weights + first;
        float *const *s = sums + first;
        switch (heads - first < INT8_WEIGH_HEADS ? heads - first : INT8_WEIGH_HEADS) {
        case 1: weigh_int8_tile(block, pairs, w, s, 1, dim); break;
        case 2: weigh_int8_tile(block, pairs, w, s, 2, dim); break;
        case 3: weigh_int8_tile(block, pairs, w, s, 3, dim); break;
        default: weigh_int8_tile(block, pairs, w, s, INT8_WEIGH_HEADS, dim); break;
        }
    }
}

/* The weighted int8 values of `heads` heads over the same first `rows` rows of a block, from their
 * softmax terms there (`terms[g]`): each head's weights rounded, then INT8_WEIGH_HEADS heads at a time. */
WIDE_VNNI static void weigh_int8_wide(const Int8ValueBlock *block, int64_t rows, const float *const *terms,
                                      float *const *sums, int64_t heads, int64_t dim) {
    Int8Weights weights[INT8_QUERY_HEADS_PER_JOB];
    const Int8Weights *head_weights[INT8_QUERY_HEADS_PER_JOB];
    for (int64_t g = 0; g < heads; g++) {
        round_weights_wide(terms[g], block->scale, rows, &weights[g]);
        head_weights[g] = &weights[g];
    }
    if (dim == 64) {
        weigh_int8_dim(block, (rows + 1) / 2, head_weights, sums, heads, 64);
    } else {
        weigh_int8_dim(block, (rows + 1) / 2, head_weights, sums, heads, dim);
    }
}

/* exp8 on 16 lanes, every lane the same operations (floor as a rounding toward -inf, exact either way). */
WIDE_INLINE __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(EXP_LOWEST));
    __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(EXP_LOG2E), _mm512_set1_ps(0.5f)),
                                    _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HIGH), x);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LOW), x);
    __m512 y = _mm512_set1_ps(EXP_POLY[0]);
    for (int i = 1; i < EXP_POLY_TERMS; i++) {
        y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(EXP_POLY[i]));
    }
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), x);
    y = _mm512_add_ps(y, _mm512_set1_ps(1.0f));
    __m512i exponent = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(exponent));
}

/* The softmax's terms of one head (terms[t] = exp(score - largest) for t < visible, 0 past it, written
 * to `visible` rounded up to 16: the stride leaves room) and their total, as the AVX2 code takes it:
 * 8 lanes by position modulo 8, summed in position order, then sum8 (the zeros past `visible` add
 * nothing to a sum of non-negative terms). */
WIDE static float softmax_terms_wide(float *terms, int64_t visible, float largest) {
    const __m512 top = _mm512_set1_ps(largest);
    const __m512i lane_index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m256 lanes_sum = _mm256_setzero_ps();
    for (int64_t t = 0; t < visible; t += 16) {
        __m512 term = exp16(_mm512_sub_ps(_mm512_loadu_ps(terms + t), top));
        if (t + 16 > visible) {
            const __mmask16 seen = _mm512_cmplt_epi32_mask(_mm512_add_epi32(_mm512_set1_epi32((int)t), lane_index),
                                                           _mm512_set1_epi32((int)visible));
            term = _mm512_maskz_mov_ps(seen, term);
        }
        _mm512_storeu_ps(terms + t, term);
        lanes_sum = _mm256_add_ps(lanes_sum, _mm512_castps512_ps256(term));
        lanes_sum = _mm256_add_ps(lanes_sum, _mm512_extractf32x8_ps(term, 1));
    }
    return sum8(lanes_sum);
}

/* A job: queries j0 .. j0 + count - 1 of row `row` (tokens first_token + j0 ...) against KV head `h`,
 * for the head's `group` query heads each. The job walks the row's keys, then its values, a block of
 * KEY_BLOCK positions at a time, and runs every query of the job over a block before the next, so a
 * block is read from memory once per job and from the L1 or L2 cache by its other queries (one query
 * per job read every key and value from memory: a 48-token append to a 6k history ran at a quarter of
 * the FMA units' rate). Within a block the job's query heads go two at a time for the scores
 * (score_pair) and two (weigh_rows) or six (weigh_heads_wide) at a time for the values, so a key or value
 * row loaded into registers serves them all; where every query of the job sees the whole block, the
 * values' heads group across queries. Neither the blocking nor the grouping changes
 * a query's arithmetic (the header's invariants): each query's scores, max, terms and sums are the same
 * operations in the same order as alone. `scores` holds count x group x stride floats, `sums` count x
 * group x dim. `dim` is a literal at the hot call site, so the loops over it unroll. */
AVX2 static inline __attribute__((always_inline)) void attend(const Step *s, int64_t row, int64_t j0, int64_t count,
                                                              int64_t h, float *scores, float *sums,
                                                              const int64_t dim, const int64_t group, int wide,
                                                              int vnni) {
    const int64_t chunks = dim / 8;
    const int64_t first_token = s->qo_indptr[row];
    const int64_t q_len = s->qo_indptr[row + 1] - first_token;
    const int64_t first_visible = s->kv_lens[row] - q_len + j0 + 1; /* query j0's keys; query j0 + q sees q more */
    const int64_t last_visible = first_visible + count - 1;
    /* a (query, head)'s scores in `scores`: to a multiple of 16, what the wide path writes */
    const int64_t stride = (last_visible + 15) & ~(int64_t)15;
    const int32_t *row_pages = s->pages + s->page_indptr[row];
    const int64_t value_bytes = s->half ? 2 : 4;
    const void *head_keys = (const char *)s->keys + h * s->pool_slots * dim * value_bytes;
    const void *head_values = (const char *)s->values + h * s->pool_slots * dim * value_bytes;
    /* A block of rows as the job reads them: a float16 pool's as floats, or an int8 value block's as
     * int16 on the AVX2 path (never both in one job: a pool holds its values in one form). */
    union {
        float converted[KEY_BLOCK * MAX_DIM];
        int16_t extended[KEY_BLOCK * MAX_DIM];
    } block_rows;
    float *const converted = block_rows.converted;
    int16_t *const extended = block_rows.extended;
    const float scale = 1.0f / sqrtf((float)dim);
    static const float zeros[MAX_DIM] = {0};
    const float *slot[KEY_BLOCK]; /* the block's key (then value) rows in the pool */
    /* The job's query heads, query-major (head q * group + g is query j0 + q's head g): where each
     * one's values are, and the positions it sees. */
    const int64_t job_heads = count * group;
    /* An odd job's last head is scored alone (score_one), its max in all 8 lanes; -1 where none. */
    const int64_t odd_head = job_heads % 2 ? job_heads - 1 : -1;
    const float *head_query[MAX_QUERY_HEADS_PER_JOB];
    int64_t head_visible[MAX_QUERY_HEADS_PER_JOB];
    for (int64_t qg = 0; qg < job_heads; qg++) {
        head_query[qg] = s->q + (first_token + j0 + qg / group) * s->q_stride + (h * group + qg % group) * dim;
        head_visible[qg] = first_visible + qg / group;
    }
    /* The running max of each pair of heads' scores: lanes 0-3 the pair's first head, 4-7 its second. */
    __m256 largest_lanes[MAX_QUERY_HEADS_PER_JOB / 2];
    for (int64_t pair = 0; pair < (job_heads + 1) / 2; pair++) {
        largest_lanes[pair] = _mm256_set1_ps(-INFINITY);
    }

    /* Scores, for two query heads and 4 keys at a time in position order (a key row is loaded once for
     * both heads): each key's dot product in 8 float lanes, the 8 dot products' lanes summed together in
     * one fixed tree (sum8x8), which sums each of them the same way whatever its neighbours. Keys past
     * the block's rows are zeros; a head's scores past its visible keys are dropped (the max skips them,
     * the softmax zeroes their terms), so a key's score is the same wherever the visible keys end. */
    const int64_t row_bytes = dim * value_bytes;
    float head_largest[MAX_QUERY_HEADS_PER_JOB]; /* each head's max over its visible keys' scores */
    if (s->int8_keys) {
        KeyQueries queries;
        round_queries(head_query, job_heads, dim, scale, &queries);
        float *head_scores[MAX_QUERY_HEADS_PER_JOB];
        for (int64_t qg = 0; qg < job_heads; qg++) {
            head_scores[qg] = scores + qg * stride;
        }
        if (vnni) {
            score_int8_row_wide((const uint8_t *)head_keys, row_pages, s->page_size, last_visible, &queries, job_heads,
                                head_scores, head_visible, head_largest, dim);
        } else {
            score_int8_row((const uint8_t *)head_keys, row_pages, s->page_size, last_visible, &queries, job_heads,
                           head_scores, head_visible, head_largest, dim);
        }
    }
    RowCursor keys = row_cursor(row_pages, s->page_size, s->int8_keys ? 0 : last_visible, head_keys, row_bytes);
    for (int64_t block = 0; block < last_visible && !s->int8_keys; block += KEY_BLOCK) {
        const int64_t in_block = last_visible - block < KEY_BLOCK ? last_visible - block : KEY_BLOCK;
        const int64_t block_end = block + in_block;
        next_rows(&keys, head_keys, s->half, dim, in_block, converted, slot);
        for (int64_t i = in_block; i < ((in_block + 7) & ~(int64_t)7); i++) {
            slot[i] = zeros; /* the last block's rows past the row's keys, to a multiple of 8 */
        }
        for (int64_t first_head = 0; first_head < job_heads; first_head += 2) {
            if (first_head == odd_head) { /* its max in lanes 0-7 */
                const int64_t visible = head_visible[first_head];
                const int64_t end = ((block_end < visible ? block_end : visible) + 7) & ~(int64_t)7;
                largest_lanes[first_head / 2] =
                    score_one(slot, block, end, head_query[first_head], scores + first_head * stride, scale,
                              visible, largest_lanes[first_head / 2], dim);
                break;
            }
            if (wide && first_head + 4 <= (odd_head >= 0 ? odd_head : job_heads)) { /* two pairs at once */
                const int64_t last = head_visible[first_head + 3];
                const int64_t end = ((block_end < last ? block_end : last) + 7) & ~(int64_t)7;
                __m256 limits[2];
                int64_t all_seen[2];
                float *pair_scores[4];
                for (int64_t i = 0; i < 4; i++) {
                    pair_scores[i] = scores + (first_head + i) * stride;
                }
                for (int64_t pair = 0; pair < 2; pair++) {
                    const int64_t a = first_head + 2 * pair;
                    limits[pair] = _mm256_setr_m128(_mm_set1_ps((float)head_visible[a]),
                                                    _mm_set1_ps((float)head_visible[a + 1]));
                    all_seen[pair] = head_visible[a];
                }
                score_quad_wide(slot, block, end, head_query + first_head, pair_scores, scale, limits, all_seen,
                                largest_lanes + first_head / 2, dim);
                first_head += 2;
                continue;
            }
            const int64_t second_head = first_head + 1;
            const int64_t visible_a = head_visible[first_head];
            const int64_t visible_b = head_visible[second_head]; /* >= visible_a */
            /* To a multiple of 8 past the visible keys, so both heads' scores are written up to the
             * softmax's stride. */
            const int64_t end = ((block_end < visible_b ? block_end : visible_b) + 7) & ~(int64_t)7;
            const __m256 limits = _mm256_setr_m128(_mm_set1_ps((float)visible_a), _mm_set1_ps((float)visible_b));
            float *scores_a = scores + first_head * stride, *scores_b = scores + second_head * stride;
            if (wide) {
                largest_lanes[first_head / 2] =
                    score_pair_wide(slot, block, end, head_query[first_head], head_query[second_head], scores_a,
                                    scores_b, scale, limits, visible_a, largest_lanes[first_head / 2], dim);
            } else {
                largest_lanes[first_head / 2] =
                    score_pair(slot, block, end, head_query[first_head], head_query[second_head], scores_a, scores_b,
                               scale, limits, visible_a, largest_lanes[first_head / 2], dim);
            }
        }
    }

    for (int64_t qg = 0; qg < job_heads && !s->int8_keys; qg++) {
        float lanes[8];
        _mm256_storeu_ps(lanes, largest_lanes[qg / 2]);
        float largest = -INFINITY;
        /* A pair's first head in lanes 0-3, its second in 4-7; an odd job's last head in all 8. */
        for (int64_t i = 4 * (qg % 2); i < (qg == odd_head ? 8 : 4 * (qg % 2) + 4); i++) {
            largest = lanes[i] > largest ? lanes[i] : largest;
        }
        head_largest[qg] = largest;
    }

    float totals[MAX_QUERY_HEADS_PER_JOB];
    for (int64_t q = 0; q < count; q++) {
        const int64_t visible = first_visible + q;
        const int64_t own_stride = (visible + 7) & ~(int64_t)7; /* the lanes this query wrote */
        for (int64_t g = 0; g < group; g++) {
            const int64_t qg = q * group + g;
            const float largest = head_largest[qg];
            float *terms = scores + qg * stride;
            if (wide) {
                totals[qg] = softmax_terms_wide(terms, visible, largest);
                continue;
            }
            /* The softmax's terms (the lanes past the keys exactly 0), summed as they are taken: 8 lanes by
             * position modulo 8, in position order. */
            const __m256 top = _mm256_set1_ps(largest);
            const __m256 lane_index = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
            __m256 lanes_sum = _mm256_setzero_ps();
            for (int64_t t = 0; t < own_stride; t += 8) {
                __m256 term = exp8(_mm256_sub_ps(_mm256_loadu_ps(terms + t), top));
                if (t + 8 > visible) {
                    const __m256 seen = _mm256_cmp_ps(_mm256_add_ps(_mm256_set1_ps((float)t), lane_index),
                                                      _mm256_set1_ps((float)visible), _CMP_LT_OQ);
                    term = _mm256_and_ps(term, seen);
                }
                _mm256_storeu_ps(terms + t, term);
                lanes_sum = _mm256_add_ps(lanes_sum, term);
            }
            totals[qg] = sum8(lanes_sum);
        }
    }

    /* The weighted values, each output summed in position order (its running sum kept in `sums` between
     * blocks), a value row read once per two heads (six on the wide path): across the job's queries in
     * the blocks they all see whole, a query's own heads in the block its last keys end in. */
    memset(sums, 0, sizeof(float) * (size_t)(count * group * dim));
    /* The wide path's pointers: each head's weights from the block's first position, and its sums. */
    const float *head_weights[MAX_QUERY_HEADS_PER_JOB];
    float *head_sums[MAX_QUERY_HEADS_PER_JOB];
    for (int64_t qg = 0; qg < job_heads; qg++) {
        head_sums[qg] = sums + qg * dim;
    }
    if (s->int8_values) {
        prefetch_int8_values((const uint8_t *)head_values, row_pages, s->page_size, dim, 0,
                             last_visible < KEY_BLOCK ? last_visible : KEY_BLOCK);
    }
    for (int64_t block = 0; block < last_visible && s->int8_values; block += KEY_BLOCK) {
        const int64_t in_block = last_visible - block < KEY_BLOCK ? last_visible - block : KEY_BLOCK;
        const int64_t ahead_end = last_visible - block < 2 * KEY_BLOCK ? last_visible : block + 2 * KEY_BLOCK;
        prefetch_int8_values((const uint8_t *)head_values, row_pages, s->page_size, dim, block + in_block, ahead_end);
        Int8ValueBlock rows;
        int8_value_block((const uint8_t *)head_values, row_pages, s->page_size, dim, block, in_block, &rows);
        int64_t extended_pairs = 0; /* the block's pairs in `extended` so far (the AVX2 path's) */
        const float *head_terms[MAX_QUERY_HEADS_PER_JOB]; /* each head's softmax terms from the block's first row */
        for (int64_t qg = 0; qg < job_heads; qg++) {
            head_terms[qg] = scores + qg * stride + block;
        }
        /* every head of the job sees the whole block (all together, once), or each query's heads their own rows */
        const int64_t whole = block + in_block <= first_visible;
        for (int64_t q = whole ? count - 1 : 0; q < count; q++) {
            const int64_t visible = first_visible + q;
            const int64_t rows_seen = whole ? in_block : (block + in_block < visible ? block + in_block : visible) - block;
            const int64_t first = whole ? 0 : q * group, heads = whole ? job_heads : group;
            if (rows_seen <= 0) {
                continue;
            }
            if (vnni) {
                weigh_int8_wide(&rows, rows_seen, head_terms + first, head_sums + first, heads, dim);
                continue;
            }
            if (extended_pairs < (rows_seen + 1) / 2) { /* the pairs no earlier query of the job saw */
                extend_int8_values(&rows, extended_pairs, (rows_seen + 1) / 2, dim, extended);
                extended_pairs = (rows_seen + 1) / 2;
            }
            for (int64_t qg = first; qg < first + heads; qg += AVX2_INT8_WEIGH_HEADS) {
                const int n = first + heads - qg < AVX2_INT8_WEIGH_HEADS ? (int)(first + heads - qg)
                                                                         : AVX2_INT8_WEIGH_HEADS;
                Int8Weights weights[AVX2_INT8_WEIGH_HEADS];
                for (int j = 0; j < n; j++) {
                    round_weights(head_terms[qg + j], rows.scale, rows_seen, &weights[j]);
                }
                const int64_t pairs = (rows_seen + 1) / 2;
                if (n == 2) { /* a literal head count at each call, so the loops over heads unroll */
                    weigh_int8_rows(extended, pairs, weights, head_sums + qg, 2, dim);
                } else {
                    weigh_int8_rows(extended, pairs, weights, head_sums + qg, 1, dim);
                }
            }
        }
    }
    RowCursor values = row_cursor(row_pages, s->page_size, s->int8_values ? 0 : last_visible, head_values, row_bytes);
    for (int64_t block = 0; block < last_visible && !s->int8_values; block += KEY_BLOCK) {
        const int64_t in_block = last_visible - block < KEY_BLOCK ? last_visible - block : KEY_BLOCK;
        next_rows(&values, head_values, s->half, dim, in_block, converted, slot);
        for (int64_t qg = 0; qg < job_heads && wide; qg++) {
            head_weights[qg] = scores + qg * stride + block;
        }
        if (block + in_block <= first_visible) { /* every head of the job sees the whole block */
            if (wide) {
                weigh_heads_wide(slot, in_block, head_weights, head_sums, job_heads, dim);
                continue;
            }
            /* two heads at a time across the job's queries (a query's odd head paired with the next's) */
            for (int64_t qg = 0; qg < job_heads; qg += 2) {
                const float *weights = scores + qg * stride + block;
                if (qg + 1 < job_heads) {
                    weigh_rows(slot, in_block, weights, weights + stride, sums + qg * dim, sums + (qg + 1) * dim, 2, dim);
                } else {
                    weigh_rows(slot, in_block, weights, weights, sums + qg * dim, sums + qg * dim, 1, dim);
                }
            }
            continue;
        }
        for (int64_t q = 0; q < count; q++) {
            const int64_t visible = first_visible + q;
            const int64_t rows_seen = (block + in_block < visible ? block + in_block : visible) - block;
            if (wide) { /* the query's heads, which see the same rows */
                if (rows_seen > 0) {
                    weigh_heads_wide(slot, rows_seen, head_weights + q * group, head_sums + q * group, group, dim);
                }
                continue;
            }
            for (int64_t g = 0; g < group; g += 2) {
                const int64_t qg = q * group + g;
                const float *weights = scores + qg * stride + block;
                if (g + 1 < group) {
                    weigh_rows(slot, rows_seen, weights, weights + stride, sums + qg * dim, sums + (qg + 1) * dim, 2,
                               dim);
                } else {
                    weigh_rows(slot, rows_seen, weights, weights, sums + qg * dim, sums + qg * dim, 1, dim);
                }
            }
        }
    }
    for (int64_t q = 0; q < count; q++) {
        for (int64_t g = 0; g < group; g++) {
            float *out = s->out + ((first_token + j0 + q) * s->heads + h * group + g) * dim;
            const float *sum = sums + (q * group + g) * dim;
            const __m256 total = _mm256_set1_ps(totals[q * group + g]);
            for (int64_t c = 0; c < chunks; c++) {
                _mm256_storeu_ps(out + 8 * c, _mm256_div_ps(_mm256_loadu_ps(sum + 8 * c), total));
            }
        }
    }
}

/* `*buffer` grown to at least `bytes` (what it held is not kept); NULL where it cannot grow. */
static void *grown(void **buffer, size_t *capacity, size_t bytes) {
    if (bytes > *capacity) {
        free(*buffer);
        *buffer = malloc(bytes);
        *capacity = *buffer == NULL ? 0 : bytes;
    }
    return *buffer;
}

/* This thread's scratch of at least `floats`, kept between calls (NULL where it cannot grow), as is
 * the calling thread's job table: a layer call allocates nothing once the longest row has been seen.
 * A job's scores outgrow malloc's mmap threshold past a few thousand positions, and a fresh mapping
 * per layer call cost a page fault per 4 KB, as much as the arithmetic. The scratch grows to the
 * longest row seen, so it is bounded by the model's context: MAX_QUERY_HEADS_PER_JOB x (context + dim)
 * floats per thread; the job table by the step's tokens. A thread that exits leaves both behind (no
 * destructor): the engine's thread and OpenMP's pool live as long as the process, so only a process
 * that builds engines over and over (the tests) leaves one set per engine. */
static float *thread_scratch(size_t floats) {
    static __thread void *scratch = NULL;
    static __thread size_t capacity = 0;
    return grown(&scratch, &capacity, sizeof(float) * floats);
}

/* The calling thread's job table for `runs` runs: run b is row [3b], its queries [3b + 1] .. [3b + 1] + [3b + 2] - 1. */
static int32_t *thread_jobs(int64_t runs) {
    static __thread void *jobs = NULL;
    static __thread size_t capacity = 0;
    return grown(&jobs, &capacity, sizeof(int32_t) * 3 * (size_t)runs);
}

/* The queries of one row a job takes at most: the heads of the pool's form (above), or the int8 forms' 32
 * heads where the float forms' 96 would not split evenly across the threads, the busiest thread's share
 * more than 1.25x the mean (one row's append over SmolLM2's 3 KV heads, 3 jobs on 2 threads: 1.16x the
 * time of 6 smaller ones). Which queries share a job changes no bit (the header's invariants). */
static int64_t queries_per_job(const Step *s, int threads) {
    const int64_t group = s->heads / s->kv_heads;
    const int64_t fewer = INT8_QUERY_HEADS_PER_JOB / group;
    if (s->int8_keys) {
        return fewer;
    }
    const int64_t more = FLOAT_QUERY_HEADS_PER_JOB / group;
    int64_t runs = 0;
    for (int64_t row = 0; row < s->rows; row++) {
        runs += (s->qo_indptr[row + 1] - s->qo_indptr[row] + more - 1) / more;
    }
    const int64_t jobs = runs * s->kv_heads, busiest = (jobs + threads - 1) / threads;
    return 4 * busiest * threads <= 5 * jobs ? more : fewer;
}

/* Returns 0, or -1 where a buffer could not be allocated (the jobs' outputs unwritten). */
AVX2 static int attend_step(const Step *s, int64_t longest, int threads, int wide, int vnni) {
    /* The new keys and values first: a row's later queries read its earlier ones. */
    for (int64_t row = 0; row < s->rows; row++) {
        const int64_t first_token = s->qo_indptr[row];
        const int64_t q_len = s->qo_indptr[row + 1] - first_token;
        const int32_t *row_pages = s->pages + s->page_indptr[row];
        for (int64_t j = 0; j < q_len; j++) {
            const int64_t position = s->kv_lens[row] - q_len + j;
            const int64_t slot = (int64_t)row_pages[position / s->page_size] * s->page_size + position % s->page_size;
            for (int64_t h = 0; h < s->kv_heads; h++) {
                const size_t at = (size_t)((h * s->pool_slots + slot) * s->dim);
                const float *key = s->k_new + (first_token + j) * s->k_stride + h * s->dim;
                const float *value = s->v_new + (first_token + j) * s->v_stride + h * s->dim;
                if (s->half) { /* rounded to nearest even, as torch's .to(torch.float16) */
                    uint16_t *keys = (uint16_t *)s->keys + at, *values = (uint16_t *)s->values + at;
                    if (s->int8_keys) { /* the key's page, from its first slot's float16s */
                        uint16_t *page = keys - position % s->page_size * s->dim;
                        store_int8_row((uint8_t *)page, s->page_size, position % s->page_size, key, s->dim,
                                       INT8_KEY_LAYOUT);
                    }
                    if (s->int8_values) {
                        uint16_t *page = values - position % s->page_size * s->dim;
                        store_int8_row((uint8_t *)page, s->page_size, position % s->page_size, value, s->dim,
                                       INT8_VALUE_LAYOUT);
                    }
                    for (int64_t c = 0; c < s->dim; c += 8) {
                        if (!s->int8_keys) {
                            _mm_storeu_si128((__m128i *)(keys + c),
                                             _mm256_cvtps_ph(_mm256_loadu_ps(key + c), _MM_FROUND_TO_NEAREST_INT));
                        }
                        if (!s->int8_values) {
                            _mm_storeu_si128((__m128i *)(values + c),
                                             _mm256_cvtps_ph(_mm256_loadu_ps(value + c), _MM_FROUND_TO_NEAREST_INT));
                        }
                    }
                } else {
                    memcpy((float *)s->keys + at, key, sizeof(float) * s->dim);
                    memcpy((float *)s->values + at, value, sizeof(float) * s->dim);
                }
            }
        }
    }
    const int64_t group = s->heads / s->kv_heads;
    const int64_t per_job = queries_per_job(s, threads); /* queries of one row a job takes, at most */
    /* A row's queries in the fewest runs of at most per_job, of sizes that differ by one at most (16
     * queries as 8 + 8, not 10 + 6: two threads share a short append's jobs evenly). */
    int64_t runs = 0;
    for (int64_t row = 0; row < s->rows; row++) {
        runs += (s->qo_indptr[row + 1] - s->qo_indptr[row] + per_job - 1) / per_job;
    }
    int32_t *const run_of = thread_jobs(runs);
    if (run_of == NULL) {
        return -1;
    }
    for (int64_t row = 0, b = 0; row < s->rows; row++) {
        const int64_t q_len = s->qo_indptr[row + 1] - s->qo_indptr[row];
        const int64_t row_runs = (q_len + per_job - 1) / per_job;
        for (int64_t r = 0; r < row_runs; r++, b++) {
            run_of[3 * b] = (int32_t)row;
            run_of[3 * b + 1] = (int32_t)(r * q_len / row_runs);
            run_of[3 * b + 2] = (int32_t)((r + 1) * q_len / row_runs - r * q_len / row_runs);
        }
    }
    const int64_t jobs = runs * s->kv_heads;
    const size_t score_floats = (size_t)(per_job * group * ((longest + 15) & ~(int64_t)15)); /* attend's stride */
    const size_t sum_floats = (size_t)(per_job * group * s->dim);
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && jobs > 1)
    {
        float *scores = thread_scratch(score_floats + sum_floats);
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        float *sums = scores == NULL ? NULL : scores + score_floats;
#pragma omp for schedule(dynamic, 1)
        for (int64_t job = 0; job < jobs; job++) {
            if (scores == NULL) {
                continue;
            }
            /* Head-major: consecutive jobs read one KV head's keys and values, which stay in the L2
             * cache between them (a row's every head does not, past a few hundred positions). */
            const int64_t h = job / runs;
            const int64_t b = job % runs;
            const int64_t row = run_of[3 * b];
            const int64_t j0 = run_of[3 * b + 1];
            const int64_t count = run_of[3 * b + 2];
            if (s->dim == 64) { /* the models served here: the dot products' loops unrolled */
                attend(s, row, j0, count, h, scores, sums, 64, group, wide, vnni);
            } else {
                attend(s, row, j0, count, h, scores, sums, s->dim, group, wide, vnni);
            }
        }
    }
    return failed ? -1 : 0;
}
#endif

static int cpu_supported(void) {
#ifdef CPU_KERNEL_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
    return 0;
#endif
}

static PyObject *supported(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyBool_FromLong(cpu_supported());
}

static int wide_supported(void) {
#ifdef CPU_KERNEL_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
#else
    return 0;
#endif
}

/* The int8-keys scores' AVX-512 path needs VNNI and BW beside the wide path's F and DQ. */
static int vnni_supported(void) {
#ifdef CPU_KERNEL_X86
    __builtin_cpu_init();
    return wide_supported() && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
#else
    return 0;
#endif
}

static PyObject *wide(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyBool_FromLong(wide_supported());
}

/* Checks every row's metadata against the pool before anything is written: a bad page index would
 * write outside it. Returns the longest row's KV length, or -1 with a Python error set. */
static int64_t check_rows(const Step *s, int64_t tokens) {
    const int64_t pool_pages = s->pool_slots / s->page_size;
    int64_t longest = 0;
    if (s->qo_indptr[0] != 0 || s->qo_indptr[s->rows] != tokens || s->page_indptr[0] != 0) {
        PyErr_SetString(PyExc_ValueError, "cpu attention: the rows do not cover the step's tokens");
        return -1;
    }
    for (int64_t row = 0; row < s->rows; row++) {
        const int64_t q_len = s->qo_indptr[row + 1] - s->qo_indptr[row];
        const int64_t kv_len = s->kv_lens[row];
        const int64_t num_pages = s->page_indptr[row + 1] - s->page_indptr[row];
        if (q_len < 1 || kv_len < q_len || num_pages * s->page_size < kv_len) {
            PyErr_Format(PyExc_ValueError, "cpu attention: row %lld feeds %lld tokens of %lld in %lld pages",
                         (long long)row, (long long)q_len, (long long)kv_len, (long long)num_pages);
            return -1;
        }
        for (int64_t p = s->page_indptr[row]; p < s->page_indptr[row + 1]; p++) {
            if (s->pages[p] < 0 || s->pages[p] >= pool_pages) {
                PyErr_Format(PyExc_ValueError, "cpu attention: page %d is outside the pool of %lld", s->pages[p],
                             (long long)pool_pages);
                return -1;
            }
        }
        longest = kv_len > longest ? kv_len : longest;
    }
    return longest;
}

/* attend(q, q_stride, k, k_stride, v, v_stride, tokens, keys, values, pool_slots, qo_indptr, kv_lens,
 * page_indptr, pages, rows, heads, kv_heads, dim, page_size, out, threads, half[, wide[, int8_keys]]):
 * addresses as ints, float32 and int32 tensors the caller owns (layouts above), the pool float16 where
 * `half` is true, float32 otherwise, its keys in the int8-keys form where `int8_keys` is (with `half`,
 * a page_size a multiple of 16); `wide` false keeps the AVX2 path where the CPU has AVX-512 (the same
 * bits: tests compare them). */
static PyObject *attend_layer(PyObject *self, PyObject *args) {
    (void)self;
    Py_ssize_t q, k, v, keys, values, qo, kv_lens, page_indptr, pages, out;
    Py_ssize_t q_stride, k_stride, v_stride, tokens, pool_slots, rows, heads, kv_heads, dim, page_size;
    int threads, half;
    int allow_wide = 1, int8_keys = 0, int8_values = 0;
    if (!PyArg_ParseTuple(args, "nnnnnnnnnnnnnnnnnnnnip|ppp", &q, &q_stride, &k, &k_stride, &v, &v_stride, &tokens,
                          &keys, &values, &pool_slots, &qo, &kv_lens, &page_indptr, &pages, &rows, &heads,
                          &kv_heads, &dim, &page_size, &out, &threads, &half, &allow_wide, &int8_keys,
                          &int8_values)) {
        return NULL;
    }
    if (int8_values && !int8_keys) {
        PyErr_SetString(PyExc_ValueError, "cpu attention: int8 values come with int8 keys");
        return NULL;
    }
    if (int8_keys && (!half || page_size % 16)) {
        PyErr_Format(PyExc_ValueError, "cpu attention: int8 keys need a float16 pool of pages of a multiple of 16 "
                                       "(page_size=%zd)", page_size);
        return NULL;
    }
    if (!cpu_supported()) {
        PyErr_SetString(PyExc_RuntimeError, "the cpu attention kernel needs AVX2, FMA and F16C");
        return NULL;
    }
    if (tokens < 1 || rows < 1 || kv_heads < 1 || heads % kv_heads || heads / kv_heads > MAX_GROUP || dim < 8 ||
        dim % VALUE_PART || dim > MAX_DIM || page_size < 1 || pool_slots % page_size || threads < 1) {
        PyErr_Format(PyExc_ValueError,
                     "cpu attention: bad shape tokens=%zd rows=%zd heads=%zd kv_heads=%zd dim=%zd page_size=%zd",
                     tokens, rows, heads, kv_heads, dim, page_size);
        return NULL;
    }
    const Step s = {
        .q = (const float *)q,
        .q_stride = q_stride,
        .k_new = (const float *)k,
        .k_stride = k_stride,
        .v_new = (const float *)v,
        .v_stride = v_stride,
        .keys = (void *)keys,
        .values = (void *)values,
        .pool_slots = pool_slots,
        .half = half,
        .int8_keys = int8_keys,
        .int8_values = int8_values,
        .qo_indptr = (const int32_t *)qo,
        .kv_lens = (const int32_t *)kv_lens,
        .page_indptr = (const int32_t *)page_indptr,
        .pages = (const int32_t *)pages,
        .rows = rows,
        .heads = heads,
        .kv_heads = kv_heads,
        .dim = dim,
        .page_size = page_size,
        .out = (float *)out,
    };
    const int64_t longest = check_rows(&s, tokens);
    if (longest < 0) {
        return NULL;
    }
#ifdef CPU_KERNEL_X86
    int status;
    Py_BEGIN_ALLOW_THREADS;
    status = attend_step(&s, longest, threads, allow_wide && wide_supported(), allow_wide && vnni_supported());
    Py_END_ALLOW_THREADS;
    if (status < 0) {
        return PyErr_NoMemory();
    }
#endif
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"supported", supported, METH_NOARGS, "Whether this CPU runs the kernel (AVX2, FMA and F16C)."},
    {"wide", wide, METH_NOARGS, "Whether attend takes its AVX-512 path here (the same bits as AVX2's)."},
    {"attend", attend_layer, METH_VARARGS,
     "Write a step's new K and V into the pool, then attend (cpu_kernel.c's header); addresses as ints."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_kernel", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__cpu_kernel(void) { return PyModule_Create(&module); }
