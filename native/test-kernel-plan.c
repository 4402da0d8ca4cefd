// The kernel plan's exactness, at the level of the kernels: every variant the plan can choose (llama.cpp's own
// kernels, the multi-column kernels with and without their 512-bit paths, at several prefetch distances) computes
// matrix products of K-quant weights with 1-16 activation columns, plain and repacked weight layouts, on 1-3
// threads; every column of every multi-column pass must equal, bit for bit, the same column multiplied alone by
// llama.cpp's own one-column kernels. (The cases follow ggml's test-backend-ops MUL_MAT cases: weights of one type,
// f32 activations, ggml_mul_mat on the CPU backend.) llama.cpp's own kernels are not held to this; the widths where
// they match are printed, for the record.
//
//   cc -O2 test-kernel-plan.c -I GGML_INCLUDE -L LIB -lggml -lggml-base -lggml-cpu -o test-kernel-plan
//   ./test-kernel-plan [LAYOUT]          exit 0: every variant exact; 1: a mismatch (each printed). LAYOUT, plain or
//                                        repacked, runs that layout alone (llama.cpp's repacked layouts crashed its
//                                        loop on an AMX Xeon: a crash there must not hide the plain layout's result)
//   ./test-kernel-plan [LAYOUT] --flip   negative control: one bit of one result is flipped before comparing; must
//                                        exit 1

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// specdec's kernel plan (native/llama.cpp-verify-columns.patch), exported by libggml-cpu
#define KERNEL_MULTI_COLUMN 1
#define KERNEL_WIDE 2
#define MAX_WIDTH 16
void ggml_cpu_set_kernel_plan(int widths, const int * flags, const int * prefetch);
int ggml_cpu_kernel_flags_available(void);

enum { K = 1536, ROWS = 264 };  // the default target's hidden size; 33 repacked row groups of 8 (an odd count)

struct variant {
    int flags;
    int prefetch;
};

static void use_everywhere(struct variant v) {
    int flags[MAX_WIDTH], prefetch[MAX_WIDTH];
    for (int w = 0; w < MAX_WIDTH; ++w) {
        flags[w] = v.flags;
        prefetch[w] = v.prefetch;
    }
    ggml_cpu_set_kernel_plan(MAX_WIDTH, flags, prefetch);
}

static float uniform(uint64_t * state) {
    *state = *state * 6364136223846793005ULL + 1442695040888963407ULL;
    return (float) ((*state >> 40) & 0xFFFFFF) / (float) 0x800000 - 1.0f;
}

// The weights, quantized once, in one layout: a tensor in its own buffer.
struct weights {
    struct ggml_context * ctx;
    ggml_backend_buffer_t buffer;
    struct ggml_tensor * tensor;
};

static ggml_backend_buffer_type_t repack_buffer_type(void) {
    ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
    ggml_backend_dev_get_extra_bufts_t get_extra =
        (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
    for (ggml_backend_buffer_type_t * buft = get_extra ? get_extra(dev) : NULL; buft && *buft; ++buft) {
        if (strcmp(ggml_backend_buft_name(*buft), "CPU_REPACK") == 0) {
            return *buft;
        }
    }
    return NULL;
}

static struct weights make_weights(enum ggml_type type, ggml_backend_buffer_type_t buft, uint64_t seed) {
    struct ggml_init_params params = { ggml_tensor_overhead() * 2, NULL, true };
    struct weights w = { ggml_init(params), NULL, NULL };
    w.tensor = ggml_new_tensor_2d(w.ctx, type, K, ROWS);
    w.buffer = ggml_backend_alloc_ctx_tensors_from_buft(w.ctx, buft);
    float * values = malloc(sizeof(float) * K * ROWS);
    for (int i = 0; i < K * ROWS; ++i) {
        values[i] = uniform(&seed) * (1 + (i % 97 == 0) * 8);  // a few large weights, as real rows have
    }
    void * quantized = malloc(ggml_row_size(type, K) * ROWS);
    ggml_quantize_chunk(type, values, quantized, 0, ROWS, K, NULL);
    ggml_backend_tensor_set(w.tensor, quantized, 0, ggml_nbytes(w.tensor));  // the repack buffer repacks here
    free(quantized);
    free(values);
    return w;
}

// out[c * ROWS + r] = row r of the weights times column c of x, for `width` columns, in one ggml_mul_mat
static void multiply(ggml_backend_t backend, struct ggml_tensor * weights, const float * x, int width, float * out) {
    struct ggml_init_params params = { ggml_tensor_overhead() * 4 + ggml_graph_overhead(), NULL, true };
    struct ggml_context * ctx = ggml_init(params);
    struct ggml_tensor * columns = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, K, width);
    struct ggml_tensor * product = ggml_mul_mat(ctx, weights, columns);
    struct ggml_cgraph * graph = ggml_new_graph(ctx);
    ggml_build_forward_expand(graph, product);
    ggml_backend_buffer_t buffer = ggml_backend_alloc_ctx_tensors(ctx, backend);
    ggml_backend_tensor_set(columns, x, 0, ggml_nbytes(columns));
    if (ggml_backend_graph_compute(backend, graph) != GGML_STATUS_SUCCESS) {
        fprintf(stderr, "graph computation failed\n");
        exit(2);
    }
    ggml_backend_tensor_get(product, out, 0, ggml_nbytes(product));
    ggml_backend_buffer_free(buffer);
    ggml_free(ctx);
}

int main(int argc, char ** argv) {
    bool flip = false;
    const char * only = NULL;  // "plain" or "repacked"
    for (int i = 1; i < argc; ++i) {
        if (strcmp(argv[i], "--flip") == 0) {
            flip = true;
        } else if (!only && (strcmp(argv[i], "plain") == 0 || strcmp(argv[i], "repacked") == 0)) {
            only = argv[i];
        } else {
            fprintf(stderr, "usage: %s [plain|repacked] [--flip]\n", argv[0]);
            return 2;
        }
    }
    ggml_backend_t backend = ggml_backend_cpu_init();
    ggml_backend_buffer_type_t repacked = repack_buffer_type();
    const bool wide = ggml_cpu_kernel_flags_available() & KERNEL_WIDE;

    struct variant variants[8];
    int n_variants = 0;
    const int distances[] = { 0, 4096, 16384 };
    for (int d = 0; d < 3; ++d) {
        variants[n_variants++] = (struct variant) { KERNEL_MULTI_COLUMN, distances[d] };
        if (wide) {
            variants[n_variants++] = (struct variant) { KERNEL_MULTI_COLUMN | KERNEL_WIDE, distances[d] };
        }
    }
    const struct variant own = { 0, 0 };

    float * x = malloc(sizeof(float) * K * MAX_WIDTH);
    uint64_t seed = 7;
    for (int i = 0; i < K * MAX_WIDTH; ++i) {
        x[i] = uniform(&seed) * 3;
    }
    float * reference = malloc(sizeof(float) * ROWS * MAX_WIDTH);
    float * out = malloc(sizeof(float) * ROWS * MAX_WIDTH);

    const struct {
        enum ggml_type type;
        bool repack;
    } cases[] = { { GGML_TYPE_Q4_K, false }, { GGML_TYPE_Q6_K, false }, { GGML_TYPE_Q4_K, true } };
    int failures = 0, checks = 0;
    for (size_t ci = 0; ci < sizeof(cases) / sizeof(cases[0]); ++ci) {
        if (only && (strcmp(only, "repacked") == 0) != cases[ci].repack) {
            continue;
        }
        if (cases[ci].repack && repacked == NULL) {
            printf("%s repacked: no repacked layout on this CPU, skipped\n", ggml_type_name(cases[ci].type));
            continue;
        }
        struct weights w = make_weights(cases[ci].type, cases[ci].repack ? repacked : ggml_backend_cpu_buffer_type(),
                                        11 + ci);
        const char * layout = cases[ci].repack ? "repacked" : "plain";
        for (int threads = 1; threads <= 3; ++threads) {
            ggml_backend_cpu_set_n_threads(backend, threads);
            use_everywhere(own);
            for (int c = 0; c < MAX_WIDTH; ++c) {
                multiply(backend, w.tensor, x + c * K, 1, reference + c * ROWS);
            }
            for (int v = -1; v < n_variants; ++v) {
                use_everywhere(v < 0 ? own : variants[v]);
                char name[64];
                if (v < 0) {
                    snprintf(name, sizeof(name), "llama.cpp's own");
                } else {
                    snprintf(name, sizeof(name), "multi-column%s prefetch %d", variants[v].flags & KERNEL_WIDE ?
                             " 512-bit" : " 256-bit", variants[v].prefetch);
                }
                char own_exact[128] = "";
                for (int width = 1; width <= MAX_WIDTH; ++width) {
                    multiply(backend, w.tensor, x, width, out);
                    if (flip && v == n_variants - 1 && width == MAX_WIDTH) {
                        uint32_t bits;
                        memcpy(&bits, &out[ROWS + 5], 4);
                        bits ^= 1;
                        memcpy(&out[ROWS + 5], &bits, 4);
                    }
                    const bool same = memcmp(out, reference, sizeof(float) * ROWS * width) == 0;
                    if (v < 0) {
                        if (same) {
                            snprintf(own_exact + strlen(own_exact), sizeof(own_exact) - strlen(own_exact), " %d", width);
                        }
                        continue;
                    }
                    ++checks;
                    if (!same) {
                        ++failures;
                        for (int i = 0; i < ROWS * width; ++i) {
                            if (memcmp(&out[i], &reference[i], 4) != 0) {
                                printf("MISMATCH %s %s, %d threads, %s, %d columns: column %d row %d: %.9g, alone %.9g\n",
                                       ggml_type_name(cases[ci].type), layout, threads, name, width, i / ROWS,
                                       i % ROWS, out[i], reference[i]);
                                break;
                            }
                        }
                    }
                }
                if (v < 0) {
                    printf("%s %s, %d threads: llama.cpp's own kernels equal one-column passes at widths:%s\n",
                           ggml_type_name(cases[ci].type), layout, threads, own_exact);
                }
            }
        }
        ggml_backend_buffer_free(w.buffer);
        ggml_free(w.ctx);
    }
    printf("%d of %d multi-column passes (%d variants, widths 1-%d) equal one-column passes of llama.cpp's own kernels\n",
           checks - failures, checks, n_variants, MAX_WIDTH);
    ggml_backend_free(backend);
    return failures ? 1 : 0;
}
