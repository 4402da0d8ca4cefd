// Throughput of the integer multiply-add instructions that the multi-column kernels are made of, on one core:
// 12 independent chains of each instruction (more than its latency needs), 200 million instructions, nanoseconds per
// instruction. Build and run: cc -O2 -march=native vnni.c -o vnni && ./vnni (needs AVX-512 VNNI and AVX-512 BW).
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

#define N 200000000LL
#define CHAINS 12

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(void) {
    const __m256i b = _mm256_set1_epi8(3), c = _mm256_set1_epi8(5);
    const __m512i bb = _mm512_set1_epi8(3), cc = _mm512_set1_epi8(5);
    __m256i a[CHAINS];
    __m512i z[CHAINS];
    int sink = 0;

    for (int i = 0; i < CHAINS; i++) a[i] = _mm256_set1_epi32(i);
    double t = now();
    for (long long i = 0; i < N / CHAINS; i++) {
#pragma GCC unroll 12
        for (int j = 0; j < CHAINS; j++) a[j] = _mm256_dpbusd_epi32(a[j], b, c);
        __asm__ volatile("" : "+x"(a[0]), "+x"(a[1]), "+x"(a[2]), "+x"(a[3]));
    }
    printf("vpdpbusd ymm: %.3f ns\n", (now() - t) / N * 1e9);
    for (int i = 0; i < CHAINS; i++) sink += _mm256_extract_epi32(a[i], 0);

    for (int i = 0; i < CHAINS; i++) z[i] = _mm512_set1_epi32(i);
    t = now();
    for (long long i = 0; i < N / CHAINS; i++) {
#pragma GCC unroll 12
        for (int j = 0; j < CHAINS; j++) z[j] = _mm512_dpbusd_epi32(z[j], bb, cc);
        __asm__ volatile("" : "+v"(z[0]), "+v"(z[1]), "+v"(z[2]), "+v"(z[3]));
    }
    printf("vpdpbusd zmm: %.3f ns\n", (now() - t) / N * 1e9);
    for (int i = 0; i < CHAINS; i++) sink += _mm512_reduce_add_epi32(z[i]);

    for (int i = 0; i < CHAINS; i++) a[i] = _mm256_set1_epi32(i);
    t = now();
    for (long long i = 0; i < N / CHAINS; i++) {
#pragma GCC unroll 12
        for (int j = 0; j < CHAINS; j++) a[j] = _mm256_maddubs_epi16(a[j], c);
        __asm__ volatile("" : "+x"(a[0]), "+x"(a[1]), "+x"(a[2]), "+x"(a[3]));
    }
    printf("vpmaddubsw ymm: %.3f ns\n", (now() - t) / N * 1e9);
    for (int i = 0; i < CHAINS; i++) sink += _mm256_extract_epi32(a[i], 0);
    return sink == 42;  // (uses the results, so that nothing is optimised away)
}
