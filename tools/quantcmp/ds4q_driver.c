/*
 * ds4q_driver: runs ds4's own quantizer (antirez/ds4, gguf-tools/deepseek4-quantize.c and
 * quants.c, fetched and built at run time by tools/quantcmp/run.sh; never committed here) on
 * raw f32 matrices, for tools/quantcmp's comparison with ds4-gguf's quantizer.
 *
 * The tool's source file is compiled into this one with its `main` renamed, so the matrices
 * go through the tool's own per-tensor path: its imatrix reader and lookup (per-expert slice
 * of a packed entry) and its conversion function (with its fallback importance for IQ2_XXS
 * when there is no imatrix entry). Nothing of that logic is restated here.
 *
 * usage: ds4q_driver TYPE_ID IN.f32 N_MAT ROWS COLS OUT.bin [IMATRIX.dat TENSOR_NAME]
 *   IN.f32 holds N_MAT row-major ROWS x COLS little-endian f32 matrices (one per expert when
 *   N_MAT > 1, else one dense tensor). OUT.bin receives the N_MAT quantized matrices back to
 *   back. With an imatrix, TENSOR_NAME is the GGUF name looked up in it (strictly).
 */
#define main ds4_deepseek4_quantize_main
#include "deepseek4-quantize.c"
#undef main

int main(int argc, char **argv) {
    if (argc != 7 && argc != 9) {
        fprintf(stderr, "usage: %s TYPE_ID IN.f32 N_MAT ROWS COLS OUT.bin [IMATRIX.dat NAME]\n", argv[0]);
        return 2;
    }
    ds4q_type type = (ds4q_type)atoi(argv[1]);
    int64_t n_mat = atoll(argv[3]), rows = atoll(argv[4]), cols = atoll(argv[5]);
    if (n_mat < 1 || rows < 1 || cols < 1) die("bad matrix count or shape");
    size_t per = (size_t)rows * (size_t)cols;
    float *src = xmalloc(per * (size_t)n_mat * sizeof(float));
    FILE *in = fopen(argv[2], "rb");
    if (!in) die_errno("open", argv[2]);
    if (fread(src, sizeof(float), per * (size_t)n_mat, in) != per * (size_t)n_mat) die("short input read");
    fclose(in);
    imatrix_store im;
    memset(&im, 0, sizeof(im));
    const char *names[2] = { NULL, NULL };
    if (argc == 9) {
        imatrix_load(&im, argv[7], true);
        names[0] = argv[8];
    }
    ds4q_quantize_init(type);
    FILE *out = fopen(argv[6], "wb");
    if (!out) die_errno("open", argv[6]);
    for (int64_t m = 0; m < n_mat; m++) {
        const float *imat = NULL;
        if (names[0]) {
            imat = imatrix_find(&im, names, 1, cols, n_mat > 1 ? (int)m : -1, n_mat > 1 ? (int)n_mat : 0);
        }
        byte_buf q = f32_to_type(src + per * (size_t)m, (int64_t)per, type, cols, imat);
        if (fwrite(q.data, 1, q.size, out) != q.size) die("short output write");
        free(q.data);
    }
    if (fclose(out) != 0) die_errno("close", argv[6]);
    if (names[0]) imatrix_free(&im);
    free(src);
    return 0;
}
