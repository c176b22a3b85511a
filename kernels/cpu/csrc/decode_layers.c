/* A pure decode step's decoder layers in one call: the kernels' own entry points in the layer's
   order, with no Python between them (decode_layers.py). */
#include <stdint.h>

typedef void (*norm_fn)(const float *, int64_t, const float *, int64_t, const float *, float, int64_t, int64_t,
                        int64_t, float *, float *, int64_t);
typedef void (*rotary_fn)(const float *, int64_t, int64_t, int64_t, int64_t, const float *, const float *, int64_t,
                          const int64_t *, float *, float *, float *, int64_t);
typedef void (*gemm_fn)(const float *, int64_t, int64_t, int64_t, const uint16_t *, int64_t, int64_t, int64_t,
                        const float *, float *, uint16_t *, float *, int64_t, int64_t, int64_t, int64_t, int64_t,
                        int64_t);
typedef int (*attention_fn)(const float *, int64_t, const float *, const float *, const int32_t *, int64_t,
                            const int64_t *, const int64_t *, const int32_t *, int64_t, float *, int64_t, int64_t,
                            int64_t, int64_t, int64_t, float, int64_t, int64_t);

/* One projection: its shape and its split over the threads (SplitWeight.plan). */
typedef struct {
    int64_t n, n_pad, k, k_pad, pass_blocks, slab_blocks, col_major, shared_split;
} gemm_spec;

/* One layer's weights and cache. */
typedef struct {
    const float *input_norm, *post_norm, *qkv_bias, *o_bias;
    const uint16_t *qkv, *o, *gate_up, *down;
    float *key_cache, *value_cache;
} layer_ptrs;

/* The step: sizes, thread counts, the rotary and attention inputs, buffers, the kernels. */
typedef struct {
    int64_t m, hidden, heads, kv_heads, head_dim, block_size, intermediate;
    int64_t lanes, norm_threads, rotary_threads, gemm_threads, attention_threads;
    double eps, scale;
    const float *cos_t, *sin_t;
    const int64_t *slots;
    const int32_t *block_tables;
    int64_t table_stride;
    const int64_t *token_index, *table_row;
    const int32_t *seq_lens;
    int64_t max_len;
    gemm_spec qkv, o, gate_up, down;
    uint16_t *split_ws;
    float *acc_ws;
    float *hidden_in, *normed, *res_a, *res_b, *qkv_out, *q, *attn_out, *o_out, *gate_up_out, *down_out;
    void *norm, *rotary, *gemm, *attention;
} step_t;

static void project(const step_t *s, const gemm_spec *g, const float *x, int64_t x_stride, const uint16_t *w,
                    const float *bias, float *y, int64_t silu_mul) {
    ((gemm_fn)s->gemm)(x, x_stride, s->m, g->k, w, g->n, g->n_pad, g->k_pad, bias, y, s->split_ws, s->acc_ws,
                       g->pass_blocks, g->slab_blocks, s->gemm_threads, g->col_major, g->shared_split, silu_mul);
}

/* The residual buffer that `res` is not (the first layer's residual is its input, not a buffer). */
static float *other(const step_t *s, const float *res) { return res == s->res_a ? s->res_b : s->res_a; }

/* Every layer in order; the last layer's MLP output is in down_out. Returns which buffer holds the
   residual to add before the final norm (0: res_a, 1: res_b), or -1 when the attention kernel could
   not allocate its scratch (the step fails, as the Python path's would). */
int decode_layers(const step_t *s, const layer_ptrs *layers, int64_t n_layers) {
    const int64_t m = s->m, h = s->hidden, q_size = s->heads * s->head_dim;
    const int64_t qkv_width = (s->heads + 2 * s->kv_heads) * s->head_dim;
    const float eps = (float)s->eps, scale = (float)s->scale;
    const norm_fn norm = (norm_fn)s->norm;
    float *res_in = 0; /* no residual before the first layer */
    for (int64_t l = 0; l < n_layers; ++l) {
        const layer_ptrs *L = &layers[l];
        const float *x = l == 0 ? s->hidden_in : s->down_out;
        /* As the Python path: the first layer's residual is its input itself, written in place. */
        float *res_out = l == 0 ? s->hidden_in : other(s, res_in);
        norm(x, h, res_in, res_in ? h : 0, L->input_norm, eps, m, h, s->lanes, s->normed, res_out, s->norm_threads);
        res_in = res_out;
        project(s, &s->qkv, s->normed, h, L->qkv, L->qkv_bias, s->qkv_out, 0);
        ((rotary_fn)s->rotary)(s->qkv_out, qkv_width, s->heads, s->kv_heads, s->head_dim, s->cos_t, s->sin_t, m,
                               s->slots, s->q, L->key_cache, L->value_cache, s->rotary_threads);
        if (((attention_fn)s->attention)(s->q, q_size, L->key_cache, L->value_cache, s->block_tables,
                                         s->table_stride, s->token_index, s->table_row, s->seq_lens, m,
                                         s->attn_out, q_size, s->heads, s->kv_heads, s->head_dim, s->block_size,
                                         scale, s->max_len, s->attention_threads) != 0)
            return -1;
        project(s, &s->o, s->attn_out, q_size, L->o, L->o_bias, s->o_out, 0);
        res_out = other(s, res_in);
        norm(s->o_out, h, res_in, h, L->post_norm, eps, m, h, s->lanes, s->normed, res_out, s->norm_threads);
        res_in = res_out;
        project(s, &s->gate_up, s->normed, h, L->gate_up, 0, s->gate_up_out, 0);
        project(s, &s->down, s->gate_up_out, 2 * s->intermediate, L->down, 0, s->down_out, 1);
    }
    return res_in == s->res_a ? 0 : 1;
}
