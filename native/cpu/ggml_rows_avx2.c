/* AVX2 kernels of the GGUF block rows (ggml_rows.h); the types without one use the scalar kernels. */
#include <stddef.h>

#include "ggml_rows.h"

moed_ggml_dot_fn moed_ggml_dot_avx2(int type) {
    (void)type;
    return NULL;
}
