/* edgeinfer's block-quantized matmul for ONNX Runtime's CPU provider (AVX-512 VNNI), registered as the
 * custom op edgeinfer.BlockMatMul: Y[M, N] = A[M, K] . W[K, N], with W packed by sdk/cpu_kernel.py.
 *
 * W is in blocks of 32 along K of 4- or 8-bit values, each column's block a scale s and a zero point
 * z: W[k, n] = s (q - z), q in 0..15 (or 0..255). Each row of A is rounded to int8 in blocks of 32
 * (scale d = max|a| / 127, as MatMulNBits does at accuracy level 4), so one block's dot product is
 *     s d (sum q aq)  -  s z (d sum aq)
 * with the first sum from VPDPBUSD (unsigned q times signed aq, four bytes to a 32-bit lane).
 *
 * Packed layout, per group of 16 columns and per block of 32 rows of K (the groups one after another,
 * each group's blocks in K order, so that a group is one sequential stream). Step t (0..7) is the
 * 64 bytes whose byte 4c + j is q[column c][row 4t + j] of the block. 4 bits:
 *   bytes 0..255   four 64-byte vectors; vector u holds step 2u in its low nibbles, 2u + 1 in its high
 *   bytes 256..287 the 16 columns' s, fp16
 *   bytes 288..319 the 16 columns' s z, fp16 (absent when symmetric: z is 8)
 * 8 bits: the eight steps (bytes 0..511), then s and s z likewise (symmetric: z is 128).
 *
 * ONNX Runtime's C API is a table of function pointers whose order never changes (new versions append
 * to it); the slots used here are named by index below, and registration checks two of them against
 * what they must return before adding the op. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define GROUP 16
#define BLOCK 32
#define ROWS 8            /* the most rows of A that share one pass over a group's weights */
#define BITS_ATTRIBUTE "bits"
#define GROUPS_A_TASK 8   /* column groups per task handed to ONNX Runtime's thread pool */
#define API_VERSION 16

typedef struct OrtStatus OrtStatus;
typedef struct OrtApi OrtApi;
typedef struct OrtApiBase {
    const OrtApi *(*GetApi)(uint32_t version);
    const char *(*GetVersionString)(void);
} OrtApiBase;

enum {  /* slots of the OrtApi table */
    CREATE_STATUS = 0,
    GET_ERROR_MESSAGE = 2,
    CREATE_CUSTOM_OP_DOMAIN = 26,
    CUSTOM_OP_DOMAIN_ADD = 27,
    ADD_CUSTOM_OP_DOMAIN = 28,
    GET_TENSOR_MUTABLE_DATA = 51,
    GET_DIMENSIONS_COUNT = 61,
    GET_DIMENSIONS = 62,
    GET_TENSOR_TYPE_AND_SHAPE = 65,
    KERNEL_INFO_GET_ATTRIBUTE_INT64 = 86,
    KERNEL_CONTEXT_GET_INPUT = 90,
    KERNEL_CONTEXT_GET_OUTPUT = 91,
    RELEASE_STATUS = 93,
    RELEASE_TENSOR_TYPE_AND_SHAPE_INFO = 99,
    GET_BUILD_INFO_STRING = 254,
    KERNEL_CONTEXT_PARALLEL_FOR = 274,
};
#define SLOT(api, slot, type) ((type)(((void *const *)(api))[slot]))

typedef OrtStatus *(*CreateStatusFn)(int code, const char *message);
typedef const char *(*GetErrorMessageFn)(const OrtStatus *);
typedef void (*ReleaseFn)(void *);
typedef OrtStatus *(*CreateDomainFn)(const char *, void **);
typedef OrtStatus *(*DomainAddFn)(void *, const void *);
typedef OrtStatus *(*AddDomainFn)(void *, void *);
typedef OrtStatus *(*GetDataFn)(const void *, void **);
typedef OrtStatus *(*GetShapeFn)(const void *, void **);
typedef OrtStatus *(*GetCountFn)(const void *, size_t *);
typedef OrtStatus *(*GetDimsFn)(const void *, int64_t *, size_t);
typedef OrtStatus *(*GetAttrFn)(const void *, const char *, int64_t *);
typedef OrtStatus *(*GetInputFn)(const void *, size_t, const void **);
typedef OrtStatus *(*GetOutputFn)(void *, size_t, const int64_t *, size_t, void **);
typedef const char *(*BuildInfoFn)(void);
typedef OrtStatus *(*ParallelForFn)(const void *, void (*)(void *, size_t), size_t, size_t, void *);

/* ONNX Runtime's OrtCustomOp, field for field up to version API_VERSION's. */
typedef struct CustomOp {
    uint32_t version;
    void *(*CreateKernel)(const struct CustomOp *, const OrtApi *, const void *);
    const char *(*GetName)(const struct CustomOp *);
    const char *(*GetExecutionProviderType)(const struct CustomOp *);
    int (*GetInputType)(const struct CustomOp *, size_t);
    size_t (*GetInputTypeCount)(const struct CustomOp *);
    int (*GetOutputType)(const struct CustomOp *, size_t);
    size_t (*GetOutputTypeCount)(const struct CustomOp *);
    void (*KernelCompute)(void *, void *);
    void (*KernelDestroy)(void *);
    int (*GetInputCharacteristic)(const struct CustomOp *, size_t);
    int (*GetOutputCharacteristic)(const struct CustomOp *, size_t);
    int (*GetInputMemoryType)(const struct CustomOp *, size_t);
    int (*GetVariadicInputMinArity)(const struct CustomOp *);
    int (*GetVariadicInputHomogeneity)(const struct CustomOp *);
    int (*GetVariadicOutputMinArity)(const struct CustomOp *);
    int (*GetVariadicOutputHomogeneity)(const struct CustomOp *);
    OrtStatus *(*CreateKernelV2)(const struct CustomOp *, const OrtApi *, const void *, void **);
    OrtStatus *(*KernelComputeV2)(void *, void *);
    OrtStatus *(*InferOutputShapeFn)(const struct CustomOp *, void *);
} CustomOp;

enum { TYPE_FLOAT = 1, ERROR_INVALID_ARGUMENT = 2, ERROR_FAIL = 1 };

/* ---- the kernel ---- */

static inline int values_bytes(int bits) { return bits == 8 ? 512 : 256; }
static inline int block_bytes(int bits, int symmetric) { return values_bytes(bits) + 32 + (symmetric ? 0 : 32); }

/* One row of A rounded to int8 per block of 32: aq[K], d[K / 32] (scales), dsums[K / 32] (d times the
 * block's sum of aq: the zero point's term). */
static void quantize_row(const float *a, int k, int8_t *aq, float *d, float *dsums) {
    for (int b = 0; b < k / BLOCK; b++) {
        __m512 v0 = _mm512_loadu_ps(a + b * BLOCK), v1 = _mm512_loadu_ps(a + b * BLOCK + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        float scale = amax / 127.0f, inverse = amax > 0 ? 127.0f / amax : 0.0f;
        __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inverse)));
        __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inverse)));
        _mm_storeu_si128((__m128i *)(aq + b * BLOCK), _mm512_cvtsepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(aq + b * BLOCK + 16), _mm512_cvtsepi32_epi8(q1));
        d[b] = scale;
        dsums[b] = scale * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    }
}

/* Y[rows, 16] of one column group, rows (1..ROWS) of A sharing each unpacked weight vector. */
static inline __attribute__((always_inline)) void tile(const uint8_t *w, const int8_t *aq, const float *d,
                                                       const float *dsums, int k, int rows, int bits,
                                                       int symmetric, float *y, int ldy) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    const int blocks = k / BLOCK, stride = block_bytes(bits, symmetric), at = values_bytes(bits);
    const float middle = bits == 8 ? 128.0f : 8.0f;  /* a symmetric block's zero point */
    __m512 acc[ROWS], offset[ROWS];  /* two chains a row, so that their FMAs overlap */
    for (int r = 0; r < rows; r++) acc[r] = offset[r] = _mm512_setzero_ps();
    for (int b = 0; b < blocks; b++, w += stride) {
        __m512i q[8];
        if (bits == 8) {
            for (int t = 0; t < 8; t++) q[t] = _mm512_loadu_si512(w + 64 * t);
        } else {
            for (int u = 0; u < 4; u++) {
                __m512i v = _mm512_loadu_si512(w + 64 * u);
                q[2 * u] = _mm512_and_si512(v, low);
                q[2 * u + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
        }
        __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + at)));
        __m512 sz = symmetric ? _mm512_mul_ps(s, _mm512_set1_ps(middle))
                              : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + at + 32)));
        for (int r = 0; r < rows; r++) {
            const int32_t *a4 = (const int32_t *)(aq + (size_t)r * k + b * BLOCK);
            __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
            for (int t = 0; t < 8; t += 2) {
                s0 = _mm512_dpbusd_epi32(s0, q[t], _mm512_set1_epi32(a4[t]));
                s1 = _mm512_dpbusd_epi32(s1, q[t + 1], _mm512_set1_epi32(a4[t + 1]));
            }
            __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(s, _mm512_set1_ps(d[r * blocks + b])), dot, acc[r]);
            offset[r] = _mm512_fmadd_ps(sz, _mm512_set1_ps(dsums[r * blocks + b]), offset[r]);
        }
    }
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(y + (size_t)r * ldy, _mm512_sub_ps(acc[r], offset[r]));
}

typedef struct {
    const uint8_t *w;
    const int8_t *aq;
    const float *d, *dsums;
    float *y;
    int m, k, n, bits, symmetric;
} Work;

/* Rows r.. of one column group in tiles of `rows` (a constant in each call, as `bits` is, so that
 * the compiler makes each loop apart); the row after the last one taken. */
static inline __attribute__((always_inline)) int tiles(const Work *work, const uint8_t *w, int g, int r, int rows, int bits) {
    const int blocks = work->k / BLOCK;
    for (; r + rows <= work->m; r += rows)
        tile(w, work->aq + (size_t)r * work->k, work->d + r * blocks, work->dsums + r * blocks, work->k, rows, bits,
             work->symmetric, work->y + (size_t)r * work->n + g * GROUP, work->n);
    return r;
}

/* One column group, every row: eight rows at a time, then four, then one. */
static inline __attribute__((always_inline)) void group(const Work *work, const uint8_t *w, int g, int bits) {
    int r = tiles(work, w, g, 0, 8, bits);
    r = tiles(work, w, g, r, 4, bits);
    tiles(work, w, g, r, 1, bits);
}

/* Task `task`: GROUPS_A_TASK column groups, every row. */
static void run_task(void *data, size_t task) {
    const Work *work = (const Work *)data;
    const int groups = work->n / GROUP, blocks = work->k / BLOCK;
    const size_t group_bytes = (size_t)blocks * block_bytes(work->bits, work->symmetric);
    int first = (int)task * GROUPS_A_TASK, last = first + GROUPS_A_TASK < groups ? first + GROUPS_A_TASK : groups;
    for (int g = first; g < last; g++) {
        if (work->bits == 8)
            group(work, work->w + g * group_bytes, g, 8);
        else
            group(work, work->w + g * group_bytes, g, 4);
    }
}

/* Y[M, N] = A[M, K] . W; each task on a thread of `pool` (or here, when there is no pool). */
static int matmul(const uint8_t *w, const float *a, float *y, int m, int k, int n, int bits, int symmetric,
                  void (*parallel)(void *, size_t, void *), void *pool) {
    const int blocks = k / BLOCK;
    int8_t *aq = (int8_t *)malloc((size_t)m * k + 8 * (size_t)m * blocks);
    if (!aq) return 0;
    float *d = (float *)(aq + (size_t)m * k), *dsums = d + (size_t)m * blocks;
    for (int r = 0; r < m; r++) quantize_row(a + (size_t)r * k, k, aq + (size_t)r * k, d + r * blocks, dsums + r * blocks);
    Work work = {w, aq, d, dsums, y, m, k, n, bits, symmetric};
    size_t tasks = (n / GROUP + GROUPS_A_TASK - 1) / GROUPS_A_TASK;
    if (parallel)
        parallel(&work, tasks, pool);
    else
        for (size_t t = 0; t < tasks; t++) run_task(&work, t);
    free(aq);
    return 1;
}

/* MatMulNBits' initializers into the layout above: B [N, K / 32, 32 * bits / 8] (4 bits: two values a
 * byte, the lower k in the low nibble), scales [N, K / 32], zero points [N, ceil(K / 32 * bits / 8)]
 * (4 bits: two a byte) or NULL for a symmetric block's. */
void edgeinfer_block_pack(const uint8_t *b, const float *scales, const uint8_t *zeros, int k, int n, int bits, uint8_t *out) {
    const int blocks = k / BLOCK, zero_row = bits == 8 ? blocks : (blocks + 1) / 2;
    const int stride = block_bytes(bits, zeros == NULL), at = values_bytes(bits), block_source = BLOCK * bits / 8;
    memset(out, 0, (size_t)(n / GROUP) * blocks * stride);
    for (int g = 0; g < n / GROUP; g++)
        for (int blk = 0; blk < blocks; blk++) {
            uint8_t *o = out + ((size_t)g * blocks + blk) * stride;
            for (int c = 0; c < GROUP; c++) {
                const size_t column = (size_t)g * GROUP + c;
                const uint8_t *source = b + (column * blocks + blk) * block_source;
                for (int i = 0; i < BLOCK; i++) {
                    int step = i / 4;
                    if (bits == 8)
                        o[64 * step + 4 * c + i % 4] = source[i];
                    else
                        o[64 * (step / 2) + 4 * c + i % 4] |= (uint8_t)(((source[i / 2] >> (4 * (i & 1))) & 0x0F) << (4 * (step & 1)));
                }
                float s = scales[column * blocks + blk];
                int z = !zeros ? (bits == 8 ? 128 : 8)
                        : bits == 8 ? zeros[column * zero_row + blk]
                                    : (zeros[column * zero_row + blk / 2] >> (4 * (blk & 1))) & 0x0F;
                uint16_t half = _cvtss_sh(s, _MM_FROUND_TO_NEAREST_INT);
                memcpy(o + at + 2 * c, &half, 2);
                if (zeros) {
                    half = _cvtss_sh(s * (float)z, _MM_FROUND_TO_NEAREST_INT);
                    memcpy(o + at + 32 + 2 * c, &half, 2);
                }
            }
        }
}

/* For tests and benchmarks without a session: one thread. */
int edgeinfer_block_matmul(const uint8_t *w, const float *a, float *y, int m, int k, int n, int bits, int symmetric) {
    return matmul(w, a, y, m, k, n, bits, symmetric, NULL, NULL) ? 0 : -1;
}

/* ---- the custom op ---- */

typedef struct {
    const OrtApi *api;
    int64_t k, n, bits, symmetric;
    const uint8_t *w;  /* the packed weights: memory the process that rewrote the graph keeps */
} Kernel;

typedef struct {
    const OrtApi *api;
    const void *context;
} Pool;

static void parallel_on_pool(void *work, size_t tasks, void *data) {
    const Pool *pool = (const Pool *)data;
    OrtStatus *status = SLOT(pool->api, KERNEL_CONTEXT_PARALLEL_FOR, ParallelForFn)(pool->context, run_task, tasks, 0, work);
    if (status) {  /* no pool to run on: run here */
        SLOT(pool->api, RELEASE_STATUS, ReleaseFn)(status);
        for (size_t t = 0; t < tasks; t++) run_task(work, t);
    }
}

static OrtStatus *fail(const OrtApi *api, int code, const char *message) {
    return SLOT(api, CREATE_STATUS, CreateStatusFn)(code, message);
}

/* The node's attributes: K, N, bits, symmetric, and the packed weights as an address and a size
 * (weights, weights_bytes). They are not an input: ONNX Runtime copies an initializer handed to it
 * from memory, and the packed weights would then be held twice. */
static OrtStatus *create_kernel(const CustomOp *op, const OrtApi *api, const void *info, void **out) {
    (void)op;
    Kernel *kernel = (Kernel *)calloc(1, sizeof(Kernel));
    if (!kernel) return fail(api, ERROR_FAIL, "edgeinfer.BlockMatMul: out of memory");
    kernel->api = api;
    GetAttrFn attribute = SLOT(api, KERNEL_INFO_GET_ATTRIBUTE_INT64, GetAttrFn);
    int64_t address = 0, size = 0;
    OrtStatus *status = attribute(info, "K", &kernel->k);
    if (!status) status = attribute(info, "N", &kernel->n);
    if (!status) status = attribute(info, "symmetric", &kernel->symmetric);
    if (!status) status = attribute(info, BITS_ATTRIBUTE, &kernel->bits);
    if (!status) status = attribute(info, "weights", &address);
    if (!status) status = attribute(info, "weights_bytes", &size);
    if (!status && kernel->bits != 4 && kernel->bits != 8)
        status = fail(api, ERROR_INVALID_ARGUMENT, "edgeinfer.BlockMatMul: bits must be 4 or 8");
    if (!status && (kernel->k % BLOCK || kernel->n % GROUP || kernel->k <= 0 || kernel->n <= 0))
        status = fail(api, ERROR_INVALID_ARGUMENT, "edgeinfer.BlockMatMul: K must be a multiple of 32 and N of 16");
    if (!status && (!address || size != (int64_t)(kernel->n / GROUP) * (kernel->k / BLOCK) * block_bytes((int)kernel->bits, (int)kernel->symmetric)))
        status = fail(api, ERROR_INVALID_ARGUMENT, "edgeinfer.BlockMatMul: the packed weights' size does not match K, N, bits and symmetric");
    if (status) {
        free(kernel);
        return status;
    }
    kernel->w = (const uint8_t *)(uintptr_t)address;
    *out = kernel;
    return NULL;
}

static OrtStatus *compute(void *data, void *context) {
    const Kernel *kernel = (const Kernel *)data;
    const OrtApi *api = kernel->api;
    const void *a = NULL;
    void *shape = NULL, *y = NULL, *a_data = NULL, *y_data = NULL;
    int64_t dims[8];
    size_t rank = 0;
    OrtStatus *status = SLOT(api, KERNEL_CONTEXT_GET_INPUT, GetInputFn)(context, 0, &a);
    if (!status) status = SLOT(api, GET_TENSOR_TYPE_AND_SHAPE, GetShapeFn)(a, &shape);
    if (!status) status = SLOT(api, GET_DIMENSIONS_COUNT, GetCountFn)(shape, &rank);
    if (!status && (rank < 1 || rank > 8)) status = fail(api, ERROR_INVALID_ARGUMENT, "edgeinfer.BlockMatMul: A must have 1 to 8 dimensions");
    if (!status) status = SLOT(api, GET_DIMENSIONS, GetDimsFn)(shape, dims, rank);
    if (shape) SLOT(api, RELEASE_TENSOR_TYPE_AND_SHAPE_INFO, ReleaseFn)(shape);
    if (status) return status;
    if (dims[rank - 1] != kernel->k) return fail(api, ERROR_INVALID_ARGUMENT, "edgeinfer.BlockMatMul: A's last dimension is not K");
    int64_t m = 1;
    for (size_t i = 0; i + 1 < rank; i++) m *= dims[i];
    dims[rank - 1] = kernel->n;
    status = SLOT(api, KERNEL_CONTEXT_GET_OUTPUT, GetOutputFn)(context, 0, dims, rank, &y);
    if (!status) status = SLOT(api, GET_TENSOR_MUTABLE_DATA, GetDataFn)(a, &a_data);
    if (!status) status = SLOT(api, GET_TENSOR_MUTABLE_DATA, GetDataFn)(y, &y_data);
    if (status || m == 0) return status;
    Pool pool = {api, context};
    if (!matmul(kernel->w, (const float *)a_data, (float *)y_data, (int)m, (int)kernel->k, (int)kernel->n,
                (int)kernel->bits, (int)kernel->symmetric, parallel_on_pool, &pool))
        return fail(api, ERROR_FAIL, "edgeinfer.BlockMatMul: out of memory for A's int8 copy");
    return NULL;
}

static void destroy_kernel(void *kernel) { free(kernel); }
static const char *op_name(const CustomOp *op) { (void)op; return "BlockMatMul"; }
static const char *op_provider(const CustomOp *op) { (void)op; return "CPUExecutionProvider"; }
static int input_type(const CustomOp *op, size_t i) { (void)op; (void)i; return TYPE_FLOAT; }
static size_t input_count(const CustomOp *op) { (void)op; return 1; }
static int output_type(const CustomOp *op, size_t i) { (void)op; (void)i; return TYPE_FLOAT; }
static size_t output_count(const CustomOp *op) { (void)op; return 1; }
static int required(const CustomOp *op, size_t i) { (void)op; (void)i; return 0; }
static int on_cpu(const CustomOp *op, size_t i) { (void)op; (void)i; return 0; }

static CustomOp block_matmul_op = {
    .version = API_VERSION,
    .GetName = op_name,
    .GetExecutionProviderType = op_provider,
    .GetInputType = input_type,
    .GetInputTypeCount = input_count,
    .GetOutputType = output_type,
    .GetOutputTypeCount = output_count,
    .KernelDestroy = destroy_kernel,
    .GetInputCharacteristic = required,
    .GetOutputCharacteristic = required,
    .GetInputMemoryType = on_cpu,
    .CreateKernelV2 = create_kernel,
    .KernelComputeV2 = compute,
};

/* What ONNX Runtime calls when a session's options register this library. */
OrtStatus *RegisterCustomOps(void *options, const OrtApiBase *base) {
    const OrtApi *api = base->GetApi(API_VERSION);
    if (!api) return NULL;  /* cannot even say why: this ONNX Runtime is older than the API used */
    const char *build = SLOT(api, GET_BUILD_INFO_STRING, BuildInfoFn)();
    OrtStatus *probe = fail(api, ERROR_FAIL, "edgeinfer probe");
    int table_holds = build && strncmp(build, "ORT Build Info", 14) == 0 &&
                      strcmp(SLOT(api, GET_ERROR_MESSAGE, GetErrorMessageFn)(probe), "edgeinfer probe") == 0;
    SLOT(api, RELEASE_STATUS, ReleaseFn)(probe);
    if (!table_holds)
        return fail(api, ERROR_FAIL, "edgeinfer.BlockMatMul: this ONNX Runtime's C API table is not the one the kernel was written for");
    static void *domain = NULL;  /* lives as long as the process: sessions keep pointers into it */
    OrtStatus *status = NULL;
    if (!domain) {
        status = SLOT(api, CREATE_CUSTOM_OP_DOMAIN, CreateDomainFn)("edgeinfer", &domain);
        if (!status) status = SLOT(api, CUSTOM_OP_DOMAIN_ADD, DomainAddFn)(domain, &block_matmul_op);
        if (status) {
            domain = NULL;
            return status;
        }
    }
    return SLOT(api, ADD_CUSTOM_OP_DOMAIN, AddDomainFn)(options, domain);
}
