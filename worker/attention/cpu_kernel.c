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
 *   nothing else: each (query token, KV head) is one job, its scores taken one key at a time in
 *   position order (one dot product of `dim` values in 8 float lanes summed in a fixed order), its
 *   softmax's max exact, its terms summed in 8 lanes by position modulo 8, its weighted values summed
 *   in position order. Whether the keys after it are absent (a chunk) or present (the history sent
 *   whole), whatever the rows beside it or the thread count, the same operations run in the same
 *   order;
 * - threads split the jobs only.
 *
 * Layouts: q [tokens, heads, dim] and the new k, v [tokens, kv_heads, dim], each with its own token
 * stride (heads and dim contiguous); the pool per layer [kv_heads, pool_slots, dim] (page p holds
 * slots p * page_size ...); out [tokens, heads, dim] contiguous. Query head h * group + g reads KV head
 * h (GQA). Row r feeds tokens qo_indptr[r] .. qo_indptr[r + 1] - 1, the last kv_lens[r] - 1 positions
 * of its KV, in pages pages[page_indptr[r] ...]; its query j sees positions 0 .. kv_len - q_len + j.
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

/* The query heads one KV head serves, and the head size, at most (the scratch and the accumulators). */
#define MAX_GROUP 16
#define MAX_DIM 256
/* Vectors of 8 values a value row is read in, for all of a group's query heads at once (so dim must
 * be a multiple of 8 * VALUE_CHUNKS). */
#define VALUE_CHUNKS 4

typedef struct {
    const float *q;
    int64_t q_stride;
    const float *k_new;
    int64_t k_stride;
    const float *v_new;
    int64_t v_stride;
    float *keys;
    float *values;
    int64_t pool_slots;
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
#define AVX2 __attribute__((target("avx2,fma")))

AVX2 static inline float sum8(__m256 v) {
    __m128 low = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    low = _mm_add_ps(low, _mm_movehl_ps(low, low));
    low = _mm_add_ss(low, _mm_shuffle_ps(low, low, 1));
    return _mm_cvtss_f32(low);
}

/* The sums of 8 vectors' lanes, as one vector: lane i is v[i]'s sum, in one fixed tree. */
AVX2 static inline __m256 sum8x8(const __m256 v[8]) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* exp for x <= 0 (Cephes' expf: 2^n times a degree-5 polynomial on the remainder, ~1 ulp). Below
 * -87.3 it returns ~1e-38 instead of the denormal: against the max term's 1 it is nothing. */
AVX2 static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3365447505531f));
    __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x);
    y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
    __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(exponent));
}

/* One job: query token `token` (query `j` of row `row`) against KV head `h`, for the head's `group`
 * query heads. `scratch` holds group x stride floats. `dim` and `group` are literals at the hot call
 * site, so the loops over them unroll and the accumulators stay in registers. */
AVX2 static inline __attribute__((always_inline)) void attend(const Step *s, int64_t token, int64_t row, int64_t j,
                                                              int64_t h, float *scratch, const int64_t dim,
                                                              const int64_t group) {
    const int64_t chunks = dim / 8;
    const int64_t q_len = s->qo_indptr[row + 1] - s->qo_indptr[row];
    const int64_t visible = s->kv_lens[row] - q_len + j + 1;
    const int64_t stride = (visible + 7) & ~(int64_t)7;
    const int32_t *row_pages = s->pages + s->page_indptr[row];
    const float *query = s->q + token * s->q_stride + h * group * dim;
    const float *head_keys = s->keys + h * s->pool_slots * dim;
    const float *head_values = s->values + h * s->pool_slots * dim;
    const float scale = 1.0f / sqrtf((float)dim);
    __m256 largest_lanes[MAX_GROUP];
    for (int64_t g = 0; g < group; g++) {
        largest_lanes[g] = _mm256_set1_ps(-INFINITY);
    }
    const __m256 lane_index = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);

    /* Scores, 8 keys at a time in position order: each key's dot product in 8 float lanes, the lanes of
     * the 8 summed together in one fixed tree (sum8x8); keys past the visible ones are zeros, their
     * scores dropped, so a key's score is computed the same way wherever the visible keys end. */
    static const float zeros[MAX_DIM] = {0};
    int64_t page = 0, offset = 0; /* where position `first` lives (no division per key) */
    for (int64_t first = 0; first < visible; first += 8) {
        const float *key[8];
        for (int64_t i = 0; i < 8; i++) {
            if (first + i < visible) {
                key[i] = head_keys + ((int64_t)row_pages[page] * s->page_size + offset) * dim;
                if (++offset == s->page_size) {
                    offset = 0;
                    page++;
                }
            } else {
                key[i] = zeros;
            }
        }
        for (int64_t g = 0; g < group; g++) {
            const float *qg = query + g * dim;
            __m256 dot[8];
            const __m256 q0 = _mm256_loadu_ps(qg);
            for (int64_t i = 0; i < 8; i++) {
                dot[i] = _mm256_mul_ps(q0, _mm256_loadu_ps(key[i]));
            }
            for (int64_t c = 1; c < chunks; c++) {
                const __m256 qc = _mm256_loadu_ps(qg + 8 * c);
                for (int64_t i = 0; i < 8; i++) {
                    dot[i] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(key[i] + 8 * c), dot[i]);
                }
            }
            const __m256 scores = _mm256_mul_ps(sum8x8(dot), _mm256_set1_ps(scale));
            _mm256_storeu_ps(scratch + g * stride + first, scores);
            /* The max over the visible lanes (max is exact in any order). */
            const __m256 seen = _mm256_cmp_ps(_mm256_add_ps(_mm256_set1_ps((float)first), lane_index),
                                              _mm256_set1_ps((float)visible), _CMP_LT_OQ);
            largest_lanes[g] =
                _mm256_max_ps(largest_lanes[g], _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), scores, seen));
        }
    }
    float largest[MAX_GROUP];
    for (int64_t g = 0; g < group; g++) {
        float lanes[8];
        _mm256_storeu_ps(lanes, largest_lanes[g]);
        largest[g] = -INFINITY;
        for (int64_t i = 0; i < 8; i++) {
            largest[g] = lanes[i] > largest[g] ? lanes[i] : largest[g];
        }
    }

    float totals[MAX_GROUP];
    for (int64_t g = 0; g < group; g++) {
        float *terms = scratch + g * stride;
        /* The softmax's terms; the lanes past the keys are exactly 0. */
        const __m256 top = _mm256_set1_ps(largest[g]);
        for (int64_t t = 0; t < stride; t += 8) {
            _mm256_storeu_ps(terms + t, exp8(_mm256_sub_ps(_mm256_loadu_ps(terms + t), top)));
        }
        for (int64_t t = visible; t < stride; t++) {
            terms[t] = 0.0f;
        }
        __m256 lanes = _mm256_setzero_ps();
        for (int64_t t = 0; t < stride; t += 8) {
            lanes = _mm256_add_ps(lanes, _mm256_loadu_ps(terms + t));
        }
        totals[g] = sum8(lanes);
    }

    /* The weighted values, each output summed in position order. VALUE_CHUNKS vectors of a value row
     * at a time serve every query head of the group, so the values are read from memory once per
     * job, not once per query head (they outgrow the L1 cache past a few hundred positions). */
    for (int64_t part = 0; part < chunks; part += VALUE_CHUNKS) {
        __m256 acc[MAX_GROUP][VALUE_CHUNKS];
        for (int64_t g = 0; g < group; g++) {
            for (int64_t c = 0; c < VALUE_CHUNKS; c++) {
                acc[g][c] = _mm256_setzero_ps();
            }
        }
        for (int64_t first = 0; first < visible; first += s->page_size) {
            const int64_t count = visible - first < s->page_size ? visible - first : s->page_size;
            const float *value =
                head_values + (int64_t)row_pages[first / s->page_size] * s->page_size * dim + 8 * part;
            for (int64_t i = 0; i < count; i++, value += dim) {
                __m256 v[VALUE_CHUNKS];
                for (int64_t c = 0; c < VALUE_CHUNKS; c++) {
                    v[c] = _mm256_loadu_ps(value + 8 * c);
                }
                for (int64_t g = 0; g < group; g++) {
                    const __m256 weight = _mm256_set1_ps(scratch[g * stride + first + i]);
                    for (int64_t c = 0; c < VALUE_CHUNKS; c++) {
                        acc[g][c] = _mm256_fmadd_ps(weight, v[c], acc[g][c]);
                    }
                }
            }
        }
        for (int64_t g = 0; g < group; g++) {
            float *out = s->out + (token * s->heads + h * group + g) * dim + 8 * part;
            const __m256 total = _mm256_set1_ps(totals[g]);
            for (int64_t c = 0; c < VALUE_CHUNKS; c++) {
                _mm256_storeu_ps(out + 8 * c, _mm256_div_ps(acc[g][c], total));
            }
        }
    }
}

/* Returns 0, or -1 where a thread's scratch could not be allocated (its jobs' outputs unwritten). */
AVX2 static int attend_step(const Step *s, int64_t tokens, int64_t longest, int threads) {
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
                memcpy(s->keys + at, s->k_new + (first_token + j) * s->k_stride + h * s->dim, sizeof(float) * s->dim);
                memcpy(s->values + at, s->v_new + (first_token + j) * s->v_stride + h * s->dim,
                       sizeof(float) * s->dim);
            }
        }
    }
    const int64_t group = s->heads / s->kv_heads;
    const int64_t jobs = tokens * s->kv_heads;
    const size_t scratch_floats = (size_t)(group * ((longest + 7) & ~(int64_t)7));
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && jobs > 1)
    {
        float *scratch = malloc(sizeof(float) * scratch_floats + 32);
        if (scratch == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        int64_t row = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t job = 0; job < jobs; job++) {
            /* Head-major: consecutive jobs read one KV head's keys and values, which stay in the L2
             * cache between them (a row's every head does not, past a few hundred positions). */
            const int64_t h = job / tokens;
            const int64_t token = job % tokens;
            /* The row holding `token` (rows are few; a token's row only moves forward in this loop). */
            if (token < s->qo_indptr[row]) {
                row = 0;
            }
            while (token >= s->qo_indptr[row + 1]) {
                row++;
            }
            const int64_t j = token - s->qo_indptr[row];
            if (scratch == NULL) {
                continue;
            }
            if (s->dim == 64 && group == 3) { /* SmolLM2's */
                attend(s, token, row, j, h, scratch, 64, 3);
            } else if (s->dim == 64) {
                attend(s, token, row, j, h, scratch, 64, group);
            } else {
                attend(s, token, row, j, h, scratch, s->dim, group);
            }
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}
#endif

static int cpu_supported(void) {
#ifdef CPU_KERNEL_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    return 0;
#endif
}

static PyObject *supported(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyBool_FromLong(cpu_supported());
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
 * page_indptr, pages, rows, heads, kv_heads, dim, page_size, out, threads): addresses as ints, float32
 * and int32 tensors the caller owns (layouts above). */
static PyObject *attend_layer(PyObject *self, PyObject *args) {
    (void)self;
    Step s;
    Py_ssize_t q, k, v, keys, values, qo, kv_lens, page_indptr, pages, out;
    Py_ssize_t q_stride, k_stride, v_stride, tokens, pool_slots, rows, heads, kv_heads, dim, page_size;
    int threads;
    if (!PyArg_ParseTuple(args, "nnnnnnnnnnnnnnnnnnnni", &q, &q_stride, &k, &k_stride, &v, &v_stride, &tokens,
                          &keys, &values, &pool_slots, &qo, &kv_lens, &page_indptr, &pages, &rows, &heads,
                          &kv_heads, &dim, &page_size, &out, &threads)) {
        return NULL;
    }
    if (!cpu_supported()) {
        PyErr_SetString(PyExc_RuntimeError, "the cpu attention kernel needs AVX2 and FMA");
        return NULL;
    }
    if (tokens < 1 || rows < 1 || kv_heads < 1 || heads % kv_heads || heads / kv_heads > MAX_GROUP || dim < 8 ||
        dim % (8 * VALUE_CHUNKS) || dim > MAX_DIM || page_size < 1 || pool_slots % page_size || threads < 1) {
        PyErr_Format(PyExc_ValueError,
                     "cpu attention: bad shape tokens=%zd rows=%zd heads=%zd kv_heads=%zd dim=%zd page_size=%zd",
                     tokens, rows, heads, kv_heads, dim, page_size);
        return NULL;
    }
    s = (Step){(const float *)q,     q_stride,  (const float *)k,     k_stride,  (const float *)v,
               v_stride,             (float *)keys, (float *)values, pool_slots, (const int32_t *)qo,
               (const int32_t *)kv_lens, (const int32_t *)page_indptr, (const int32_t *)pages, rows, heads,
               kv_heads,             dim,       page_size,            (float *)out};
    const int64_t longest = check_rows(&s, tokens);
    if (longest < 0) {
        return NULL;
    }
#ifdef CPU_KERNEL_X86
    int status;
    Py_BEGIN_ALLOW_THREADS;
    status = attend_step(&s, tokens, longest, threads);
    Py_END_ALLOW_THREADS;
    if (status < 0) {
        return PyErr_NoMemory();
    }
#endif
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"supported", supported, METH_NOARGS, "Whether this CPU runs the kernel (AVX2 and FMA)."},
    {"attend", attend_layer, METH_VARARGS,
     "Write a step's new K and V into the pool, then attend (cpu_kernel.c's header); addresses as ints."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_kernel", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__cpu_kernel(void) { return PyModule_Create(&module); }
