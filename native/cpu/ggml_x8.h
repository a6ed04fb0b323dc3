/* GGUF block rows interleaved in groups of eight (the "x8" layouts of a ggml expert bank on the CPU).
 *
 * The per-row kernels of ggml_rows.h spend most of their vector work per block on its scale: the 8
 * int32 lanes of one block's products must be converted and multiplied by that block's scale before
 * the next block's. With eight rows' blocks interleaved so that a 32-bit lane holds four consecutive
 * codes of one row, a lane is a row: one broadcast of four activations multiplies eight rows, their
 * integer sums accumulate without reduction, and one conversion and one multiply-add serve eight
 * blocks. llama.cpp repacks its CPU weights the same way (ggml-cpu/repack.cpp); these layouts are
 * moed's own, written for the kernels of ggml_x8_avx2.c.
 *
 * An x8 matrix holds exactly the bytes of the GGUF rows it came from, permuted within each group of
 * eight rows (rows a multiple of 8): group g is the bytes of rows 8g..8g+7, block by block, each
 * block of the group (8 rows x one GGUF block) laid out as below. Its type id is
 * MOED_GGML_X8_BASE + the GGUF type, its row_bytes the GGUF type's.
 *
 *   Q4_0 (144 bytes per 8 rows x 32 weights):
 *     [0, 16)    d of rows 0..7 (fp16)
 *     16 + 32 c + 4 r + j  (c < 4, r < 8, j < 4)   row r's qs[4 c + j]  (low nibble weight 4c+j, high 16+4c+j)
 *   MXFP4 (136 bytes per 8 rows x 32 weights): Q4_0's with the E8M0 byte of rows 0..7 in [0, 8):
 *     8 + 32 c + 4 r + j                row r's qs[4 c + j]
 *   IQ4_NL (144 bytes): Q4_0's (its codes are levels of a table)
 *   Q4_1 (160 bytes): Q4_0's with the m of rows 0..7 in [16, 32):
 *     32 + 32 c + 4 r + j               row r's qs[4 c + j]
 *   Q5_0 (176 bytes) and Q5_1 (192): Q4_0's and Q4_1's head (16 or 32 bytes: at), then the fifth bits re-packed
 *   bit for bit, then the codes:
 *     at + 4 r + j                      bit c (c < 4): qh bit 4 c + j of row r (the low nibble's of qs[4 c + j]),
 *                                       bit 4 + c: qh bit 16 + 4 c + j (the high nibble's)
 *     at + 32 + 32 c + 4 r + j          row r's qs[4 c + j]
 *   Q8_0 (272 bytes per 8 rows x 32 weights): Q4_0's with eight 4-byte chunks of int8 codes a row:
 *     [0, 16)    d of rows 0..7 (fp16)
 *     16 + 32 c + 4 r + j  (c < 8)      row r's qs[4 c + j]  (weight 4c+j)
 *   NVFP4 (288 bytes per 8 rows x 64 weights): the E4M3 byte of (row r, 16-weight sub-block h) at 8 h + r, then
 *     32 + 32 c + 4 r + j  (c < 8)      row r's qs[4 c + j] (sub-block c / 2: low nibble weight 16 (c / 2) +
 *                                       4 (c % 2) + j, high the same + 8)
 *   IQ4_XS (1088 bytes per 8 rows x 256 weights): with q = r / 4, r_ = r % 4 and sub-block s = 4 h + s_, the
 *   6-bit ls of (r, s) (w = d (ls - 32) level):
 *     [0, 16)    d of rows 0..7 (fp16)
 *     16 + 16 q + 4 s_ + r_             ls & 15 of (r, s_) | the same of (r, s_ + 4) << 4
 *     48 + 4 s_ + r_                    ls >> 4 of (r, 4 h + s_) at bits 2 (2 q + h)
 *     64 + 128 s + 32 c + 4 r + j       (c < 4) row r's qs[16 s + 4 c + j] (low nibble weight 32 s + 4 c + j,
 *                                       high 32 s + 16 + 4 c + j)
 *   Q4_K (1152 bytes per 8 rows x 256 weights):
 *     [0, 16)    d of rows 0..7, [16, 32) dmin of rows 0..7 (fp16)
 *     with q = r / 4, r_ = r % 4 and sub-block s = 4 h + s_ (h < 2, s_ < 4), the 6-bit scale sc and min m:
 *     32 + 32 h + 16 q + 4 s_ + r_      (sc & 15) | (m & 15) << 4                              of (r, s)
 *     96 + 16 q + 4 s_ + r_             sc >> 4 | (m >> 4) << 2 of (r, s_), the same << 4 of (r, s_ + 4)
 *     128 + 256 p + 32 c + 4 r + j      (p < 4, c < 8, j < 4)  row r's qs[32 p + 4 c + j]
 *                                       (low nibble: sub-block 2p weight 4c+j; high: sub-block 2p+1)
 *   Q5_K (1408 bytes per 8 rows x 256 weights): Q4_K's [0, 128), then its qh and Q4_K's codes moved up:
 *     128 + 32 c + 4 r + j              (c < 8)  row r's qh[4 c + j] (bit 2p of qh[i]: weight i of sub-block 2p)
 *     384 + 256 p + 32 c + 4 r + j      Q4_K's qs placement
 *
 * The torch twin of each layout is moed.kernels.ggml_x8_format (a byte permutation written from this
 * description); the tests check the two against each other and the kernels against the per-row ones. */
#ifndef MOED_GGML_X8_H
#define MOED_GGML_X8_H

#include <stdint.h>

enum { MOED_GGML_X8_BASE = 1100, MOED_GGML_Q4_0_X8 = 1102, MOED_GGML_Q4_1_X8 = 1103, MOED_GGML_Q5_0_X8 = 1106,
       MOED_GGML_Q5_1_X8 = 1107, MOED_GGML_Q8_0_X8 = 1108,
       MOED_GGML_Q4_K_X8 = 1112, MOED_GGML_Q5_K_X8 = 1113, MOED_GGML_IQ4_NL_X8 = 1120, MOED_GGML_IQ4_XS_X8 = 1123,
       MOED_GGML_MXFP4_X8 = 1139, MOED_GGML_NVFP4_X8 = 1140 };

/* the x8 type of a GGUF type (0: none), and the GGUF type of an x8 type (0: not one) */
int moed_ggml_x8_of(int type);
int moed_ggml_x8_base(int type);
/* the x8 type the kernels at `isa` run faster than the GGUF rows (0: keep the rows) */
int moed_ggml_x8_preferred(int type, int isa);

/* rows (a multiple of 8) x K of GGUF `type` rows at src -> the x8 layout at dst, and back (dst != src);
 * 0, or -1 for bad arguments */
int moed_ggml_x8_pack(int type, const uint8_t *src, int64_t rows, int64_t K, uint8_t *dst);
int moed_ggml_x8_unpack(int type, const uint8_t *src, int64_t rows, int64_t K, uint8_t *dst);

/* the same over the pool `h` (pack 1: rows -> x8, 0: back), a bank tensor at a time, in place where dst is
 * src (a group at a time through a buffer of its size); 0, or -1 */
int moed_cpu_ggml_x8_convert(void *h, int type, int pack, const uint8_t *src, int64_t rows, int64_t K, uint8_t *dst);

/* one group of eight x8 rows dotted with T tokens' int8 activations (ggml_rows.h's form and span):
 * y[t * ldy + r] for t < T, r < 8 */
typedef void (*moed_ggml_dot8_fn)(const uint8_t *group, int64_t K, const int8_t *xq, const float *xs,
                                  const float *xsum, int T, float *y, int64_t ldy);
/* the kernel of x8 type `x8type` at `isa`: the SIMD one, or (scalar, or a type without one) the group
 * unpacked and run row by row with moed_ggml_dot; NULL for a type that is not x8 */
moed_ggml_dot8_fn moed_ggml_dot8(int x8type, int isa);
/* one group's dot by the kernel of one ISA, y [T][8] (tests); 0, or -1 */
int moed_ggml_dot8_one(int x8type, int isa, const uint8_t *group, int64_t K, const int8_t *xq, const float *xs,
                       const float *xsum, int T, float *y);

#endif
