// Grouped products of GGUF block rows in device cache slots (the ggml bank on a GPU), loaded at run time by
// moed/devices/cuda_kernels.py (cupy RawModule, NVRTC, with native/ on the include path).
//
// For expert e (blockIdx.y) with token rows [offsets[e], offsets[e+1]) of x and its matrix in slot
// s = slot_ids[e]:
//     y[t, r] = factor[s] * sum_k x[t, k] * W_s[r, k]
// where row r of W_s is `row_bytes` bytes of GGML blocks at slots + s * slot_stride + r * row_bytes, decoded
// weight by weight in the kernel (ggml_decode.h: the torch decoders' values, bit for bit). Layout:
//     x        float32 [T, K]                  (tokens grouped by expert)
//     slots    uint8   [S, slot_stride]        (a slot row holds one expert's matrix at its start)
//     factor   float32 [S] or null             (an NVFP4 checkpoint's per-tensor scale; null: 1)
//     y        float32 [T, rows]
// One warp per output row: its lanes stride over K (consecutive lanes read consecutive weights of one
// block, so a block's bytes are read once per warp from L1), each multiplying its weight into up to
// TILE_T token rows; the warp sums by shuffles. fp32 accumulation throughout. One kernel per type (the
// type a template constant, so the decoder's switch folds away): ggml_rows_matmul_<type id>.

#include "ggml_decode.h"

#define WARPS 4
#define TILE_T 8

template <int TYPE>
__device__ __forceinline__ void ggml_rows_matmul_body(
    const float* __restrict__ x, const unsigned char* __restrict__ slots, const long long slot_stride,
    const int* __restrict__ slot_ids, const int* __restrict__ offsets, const float* __restrict__ factor,
    float* __restrict__ y, const int rows, const int K, const int row_bytes)
{
    const int e = blockIdx.y;
    const int r = blockIdx.x * WARPS + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int t_begin = offsets[e];
    const int t_end = offsets[e + 1];
    if (r >= rows || t_begin >= t_end) return;  // whole warps leave: the shuffles below see full warps
    const long long slot = slot_ids[e];
    const unsigned char* row = slots + slot * slot_stride + (long long)r * row_bytes;
    const float f = factor != nullptr ? factor[slot] : 1.0f;
    for (int t0 = t_begin; t0 < t_end; t0 += TILE_T) {
        const int nt = min(TILE_T, t_end - t0);
        float acc[TILE_T];
#pragma unroll
        for (int t = 0; t < TILE_T; ++t) acc[t] = 0.0f;
        for (int i = lane; i < K; i += 32) {
            const float w = moed_ggml_weight(TYPE, row, i);
#pragma unroll
            for (int t = 0; t < TILE_T; ++t)
                if (t < nt) acc[t] += w * x[(long long)(t0 + t) * K + i];
        }
#pragma unroll
        for (int t = 0; t < TILE_T; ++t) {
            float v = acc[t];
            for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xFFFFFFFFu, v, off);
            if (lane == 0 && t < nt) y[(long long)(t0 + t) * rows + r] = v * f;
        }
    }
}

#define MOED_GGML_KERNEL(TYPE)                                                                              \
    extern "C" __global__ void __launch_bounds__(WARPS * 32) ggml_rows_matmul_##TYPE(                      \
        const float* __restrict__ x, const unsigned char* __restrict__ slots, const long long slot_stride,  \
        const int* __restrict__ slot_ids, const int* __restrict__ offsets, const float* __restrict__ factor, \
        float* __restrict__ y, const int rows, const int K, const int row_bytes)                           \
    {                                                                                                       \
        ggml_rows_matmul_body<TYPE>(x, slots, slot_stride, slot_ids, offsets, factor, y, rows, K, row_bytes); \
    }

MOED_GGML_KERNEL(2)     // Q4_0
MOED_GGML_KERNEL(3)     // Q4_1
MOED_GGML_KERNEL(6)     // Q5_0
MOED_GGML_KERNEL(7)     // Q5_1
MOED_GGML_KERNEL(8)     // Q8_0
MOED_GGML_KERNEL(10)    // Q2_K
MOED_GGML_KERNEL(11)    // Q3_K
MOED_GGML_KERNEL(12)    // Q4_K
MOED_GGML_KERNEL(13)    // Q5_K
MOED_GGML_KERNEL(14)    // Q6_K
MOED_GGML_KERNEL(20)    // IQ4_NL
MOED_GGML_KERNEL(23)    // IQ4_XS
MOED_GGML_KERNEL(39)    // MXFP4
MOED_GGML_KERNEL(40)    // NVFP4
MOED_GGML_KERNEL(1001)  // FP8_B128
MOED_GGML_KERNEL(1002)  // MXFP8
