/* The AVX2 kernels of the GGUF block rows (ggml_rows_avx2.c) built again with the 256-bit forms of AVX-512
 * VNNI (`vpdpbusd`, `vpdpwssd` on ymm registers): on CPUs whose 512-bit instructions run as two 256-bit
 * halves (AMD Zen 4) these beat the 512-bit kernels of ggml_rows_avx512.c; moed_ggml_dot chooses. */
#define GGML_VNNI256 1
#include "ggml_rows_avx2.c"
