/* The decoder's row-wise float ops between its matrices, for the quantised forms on the CPU
 * (worker/model/row_ops_native.py): a residual add fused with the RMS norm that follows it, and the
 * rotary embedding of q and k in place. (SiLU(gate) x up stays torch's: worker/model/row_ops.py.)
 *
 * Why it exists: at a decode step's one row torch spends ~8-35 us of dispatch on each of these
 * (`F.rms_norm` alone is eight ATen ops), ~0.9 ms of a ~10 ms SmolLM2 step on the Zen 4 VM and
 * ~2.5 of ~12.7 on the Zen 3 one (docs/benchmarks.md, "The next lever in a decode step"); here
 * each is one call.
 *
 * Invariants (the engine's promise: a session's tokens do not depend on its batch or its chunking,
 * nor on its worker's CPU):
 * - a row's outputs depend on that row's inputs alone, computed in one fixed order of operations
 *   whatever the row count; one thread (the ops are a few us a step);
 * - one code path on every CPU that runs it (AVX2 and FMA, no wider path), so two workers give the
 *   same bits;
 * - the rotation and the residual add give torch's bits (each product and sum rounded once, as
 *   `apply_rotary` and `x + y` do; the file is built with -ffp-contract=off); the norm's sum of
 *   squares (8 lanes, then the lanes in a fixed tree) is this file's own, which is why the `float`
 *   form, held to transformers' bits, keeps torch's ops.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#define ROW_OPS_X86 1
#include <immintrin.h>
#endif

/* Float lanes of one AVX2 register: every row width the ops take is a multiple of it. */
#define LANES 8
/* Largest head_dim the rotation takes (its half is copied aside on the stack). */
#define MAX_HEAD_DIM 512

static int cpu_supported(void) {
#ifdef ROW_OPS_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    return 0;
#endif
}

#ifdef ROW_OPS_X86
/* x[r] += add[r] where `add` is not NULL; then out[r] = x[r] * (1 / sqrt(mean(x[r]^2) + eps)) * weight:
 * torch's order of the two products, the sum of squares in 8 lanes then ((0+1)+(2+3))+((4+5)+(6+7)). */
__attribute__((target("avx2,fma"))) static void add_rms_norm(float *x, const float *add, const float *weight,
                                                             float eps, float *out, int64_t rows, int64_t cols) {
    for (int64_t r = 0; r < rows; r++) {
        float *row = x + r * cols;
        __m256 squares = _mm256_setzero_ps();
        for (int64_t i = 0; i < cols; i += LANES) {
            __m256 v = _mm256_loadu_ps(row + i);
            if (add) {
                v = _mm256_add_ps(v, _mm256_loadu_ps(add + r * cols + i));
                _mm256_storeu_ps(row + i, v);
            }
            squares = _mm256_fmadd_ps(v, v, squares);
        }
        float lanes[LANES];
        _mm256_storeu_ps(lanes, squares);
        const float sum = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
        /* sqrtss: the correctly rounded root, as sqrtf gives, with no libm call. */
        const float root = _mm_cvtss_f32(_mm_sqrt_ss(_mm_set_ss(sum / (float)cols + eps)));
        const __m256 scale = _mm256_set1_ps(1.0f / root);
        for (int64_t i = 0; i < cols; i += LANES) {
            const __m256 normed = _mm256_mul_ps(_mm256_loadu_ps(row + i), scale);
            _mm256_storeu_ps(out + r * cols + i, _mm256_mul_ps(normed, _mm256_loadu_ps(weight + i)));
        }
    }
}

/* Each of the first `heads` head vectors of every row, in place: v = v * cos + swap_halves(v) * signed_sin
 * (rotate-half with the sign folded into the table, worker/model/rope.py), each product rounded, then
 * their sum: `apply_rotary`'s operations. cos and sin are [rows, head_dim], the rows' positions. */
__attribute__((target("avx2,fma"))) static void rotate(float *qkv, int64_t rows, int64_t row_stride, int64_t heads,
                                                       int64_t head_dim, const float *cos, const float *sin) {
    const int64_t half = head_dim / 2;
    float saved[MAX_HEAD_DIM];
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * head_dim;
        const float *s = sin + r * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            float *v = qkv + r * row_stride + h * head_dim;
            memcpy(saved, v, sizeof(float) * (size_t)head_dim);
            for (int64_t i = 0; i < head_dim; i += LANES) {
                const int64_t swapped = i < half ? i + half : i - half;
                const __m256 straight = _mm256_mul_ps(_mm256_loadu_ps(saved + i), _mm256_loadu_ps(c + i));
                const __m256 crossed = _mm256_mul_ps(_mm256_loadu_ps(saved + swapped), _mm256_loadu_ps(s + i));
                _mm256_storeu_ps(v + i, _mm256_add_ps(straight, crossed));
            }
        }
    }
}
#endif

static PyObject *supported(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return PyBool_FromLong(cpu_supported());
}

static int check_cpu(void) {
    if (!cpu_supported()) {
        PyErr_SetString(PyExc_RuntimeError, "the row ops need AVX2 and FMA");
        return 0;
    }
    return 1;
}

/* Addresses as ints: the caller owns contiguous float32 tensors of the shapes each op names. */
static PyObject *py_add_rms_norm(PyObject *self, PyObject *args) {
    (void)self;
    Py_ssize_t x_at, add_at, weight_at, out_at;
    long long rows, cols;
    float eps;
    if (!PyArg_ParseTuple(args, "nnnfnLL", &x_at, &add_at, &weight_at, &eps, &out_at, &rows, &cols) || !check_cpu()) {
        return NULL;
    }
    if (rows < 0 || cols <= 0 || cols % LANES) {
        PyErr_Format(PyExc_ValueError, "add_rms_norm: bad shape rows=%lld cols=%lld", rows, cols);
        return NULL;
    }
#ifdef ROW_OPS_X86
    add_rms_norm((float *)x_at, (const float *)add_at, (const float *)weight_at, eps, (float *)out_at, rows, cols);
#endif
    Py_RETURN_NONE;
}

static PyObject *py_rotate(PyObject *self, PyObject *args) {
    (void)self;
    Py_ssize_t qkv_at, cos_at, sin_at;
    long long rows, row_stride, heads, head_dim;
    if (!PyArg_ParseTuple(args, "nLLLLnn", &qkv_at, &rows, &row_stride, &heads, &head_dim, &cos_at, &sin_at) ||
        !check_cpu()) {
        return NULL;
    }
    if (rows < 0 || heads < 0 || head_dim <= 0 || head_dim % (2 * LANES) || head_dim > MAX_HEAD_DIM ||
        row_stride < heads * head_dim) {
        PyErr_Format(PyExc_ValueError, "rotate: bad shape rows=%lld stride=%lld heads=%lld head_dim=%lld", rows,
                     row_stride, heads, head_dim);
        return NULL;
    }
#ifdef ROW_OPS_X86
    rotate((float *)qkv_at, rows, row_stride, heads, head_dim, (const float *)cos_at, (const float *)sin_at);
#endif
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"supported", supported, METH_NOARGS, "Whether this CPU runs the row ops (AVX2 and FMA)."},
    {"add_rms_norm", py_add_rms_norm, METH_VARARGS,
     "x += add (add 0: none), out = rms_norm(x) * weight, row by row; addresses as ints."},
    {"rotate", py_rotate, METH_VARARGS, "The rotary embedding of each row's first heads, in place; addresses as ints."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_row_ops", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__row_ops(void) { return PyModule_Create(&module); }
