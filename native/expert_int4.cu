// Grouped int4 expert matmul over device cache slots, loaded at run time by moed/devices/cuda_kernels.py (cupy RawKernel).
//
// For expert e (one CUDA block row, blockIdx.y = e) with token rows [offsets[e], offsets[e+1])
// of x and weights in slot s = slot_ids[e]:
//     y[t, n] = sum_k x[t, k] * W_s[k, n],   W_s[k, n] = q * scale[k / 32, n] + min[k / 32, n]
// Layout (the host bank's, see moed/cache/host_bank.py):
//     x      float32 [T, K]              (tokens grouped by expert)
//     q      uint8   [S, K, N/2]         byte [k, j]: low nibble = column j, high nibble = column j + N/2
//     scale  bf16    [S, K/32, N]        passed as raw uint16 bits
//     min    bf16    [S, K/32, N]
//     y      float32 [T, N]
// Each thread owns one byte column j, i.e. the output columns j and j + N/2, for a tile of up to
// TILE_T tokens. Per quant group it sums x*q and x over 32 rows and applies the group's scale
// and min once: sum_k x*(q*s + m) = s * sum_k x*q + m * sum_k x. fp32 accumulation throughout.

#define GROUP 32
#define TILE_T 8
#define BLOCK 128

__device__ __forceinline__ float bf16_to_float(unsigned short bits) {
    return __uint_as_float(((unsigned int)bits) << 16);
}

extern "C" __global__ void __launch_bounds__(BLOCK)
expert_int4_grouped_matmul(
    const float* __restrict__ x,
    const unsigned char* __restrict__ q,
    const unsigned short* __restrict__ scale,
    const unsigned short* __restrict__ mn,
    const int* __restrict__ slot_ids,
    const int* __restrict__ offsets,
    float* __restrict__ y,
    const int K,
    const int N)
{
    const int e = blockIdx.y;
    const int t_begin = offsets[e];
    const int t_end = offsets[e + 1];
    if (t_begin >= t_end) return;  // uniform over the block: no thread reaches a barrier

    const int half = N / 2;
    const int j = blockIdx.x * BLOCK + threadIdx.x;  // byte column
    const bool active = j < half;
    const long long slot = slot_ids[e];
    const int groups = K / GROUP;
    const unsigned char* qs = q + slot * (long long)K * half;
    const unsigned short* ss = scale + slot * (long long)groups * N;
    const unsigned short* ms = mn + slot * (long long)groups * N;

    __shared__ float xs[TILE_T][GROUP];

    for (int t0 = t_begin; t0 < t_end; t0 += TILE_T) {
        const int nt = min(TILE_T, t_end - t0);
        float acc_lo[TILE_T], acc_hi[TILE_T];
#pragma unroll
        for (int i = 0; i < TILE_T; ++i) { acc_lo[i] = 0.f; acc_hi[i] = 0.f; }

        for (int g = 0; g < groups; ++g) {
            // stage x[t0 : t0 + TILE_T, g*32 : g*32 + 32] (zeros past the last token)
            for (int idx = threadIdx.x; idx < TILE_T * GROUP; idx += BLOCK) {
                const int tt = idx / GROUP, kk = idx % GROUP;
                xs[tt][kk] = tt < nt ? x[(long long)(t0 + tt) * K + g * GROUP + kk] : 0.f;
            }
            __syncthreads();
            if (active) {
                float sq_lo[TILE_T], sq_hi[TILE_T], sx[TILE_T];
#pragma unroll
                for (int i = 0; i < TILE_T; ++i) { sq_lo[i] = 0.f; sq_hi[i] = 0.f; sx[i] = 0.f; }
                const unsigned char* qg = qs + (long long)g * GROUP * half + j;
#pragma unroll 4
                for (int kk = 0; kk < GROUP; ++kk) {
                    const unsigned int b = qg[(long long)kk * half];
                    const float lo = (float)(b & 15u);
                    const float hi = (float)(b >> 4);
#pragma unroll
                    for (int i = 0; i < TILE_T; ++i) {
                        const float xv = xs[i][kk];
                        sq_lo[i] = fmaf(xv, lo, sq_lo[i]);
                        sq_hi[i] = fmaf(xv, hi, sq_hi[i]);
                        sx[i] += xv;
                    }
                }
                const float s_lo = bf16_to_float(ss[(long long)g * N + j]);
                const float s_hi = bf16_to_float(ss[(long long)g * N + j + half]);
                const float m_lo = bf16_to_float(ms[(long long)g * N + j]);
                const float m_hi = bf16_to_float(ms[(long long)g * N + j + half]);
#pragma unroll
                for (int i = 0; i < TILE_T; ++i) {
                    acc_lo[i] = fmaf(s_lo, sq_lo[i], fmaf(m_lo, sx[i], acc_lo[i]));
                    acc_hi[i] = fmaf(s_hi, sq_hi[i], fmaf(m_hi, sx[i], acc_hi[i]));
                }
            }
            __syncthreads();  // xs is rewritten by the next group
        }
        if (active) {
#pragma unroll
            for (int i = 0; i < TILE_T; ++i) {
                if (i < nt) {
                    y[(long long)(t0 + i) * N + j] = acc_lo[i];
                    y[(long long)(t0 + i) * N + j + half] = acc_hi[i];
                }
            }
        }
    }
}
