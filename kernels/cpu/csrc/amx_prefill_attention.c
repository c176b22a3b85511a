/* Prefill attention on the AMX tiles: a sequence's new tokens against all its keys, float32
   (amx_prefill_attention.py). */
#include "amx_tiles.h"

#include <math.h>
#include <stdlib.h>

/* The row's softmax numerators in place: s[j] <- exp(scale s[j] - max) for j < lim, 0 for lim <= j <
   width (a multiple of 16); returns their sum (1 for an empty row, which is all zeros). */
static float softmax_numerators(float *s, int64_t lim, int64_t width, float scale) {
    if (lim <= 0) { memset(s, 0, (size_t)width * sizeof(float)); return 1.0f; }
    const __m512 vscale = _mm512_set1_ps(scale);
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < lim; j += 16) {
        const __mmask16 mask = j + 16 <= lim ? (__mmask16)0xFFFF : (__mmask16)((1u << (lim - j)) - 1u);
        vmax = _mm512_mask_max_ps(vmax, mask, vmax, _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, s + j), vscale));
    }
    const __m512 vtop = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t j = 0; j < width; j += 16) {
        const __mmask16 mask = j + 16 <= lim ? (__mmask16)0xFFFF
                               : j < lim ? (__mmask16)((1u << (lim - j)) - 1u) : (__mmask16)0;
        const __m512 e = _mm512_maskz_mov_ps(mask, exp16(_mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(s + j), vscale), vtop)));
        _mm512_storeu_ps(s + j, e);
        vsum = _mm512_add_ps(vsum, e);
    }
    return _mm512_reduce_add_ps(vsum);
}

/* Key j's value row (d floats) as rows of a packed B operand whose columns are the d outputs and
   whose inputs are the keys: [d / 32][keys_pad / 32][part 3][half 2][16 key pairs][16][2]. */
static void pack_value(const float *src, int64_t d, int valid, int64_t j, int64_t key_blocks, uint16_t *out) {
    uint16_t parts[3][16];
    const int64_t kb = j / 32, r = (j & 31) / 2, e = j & 1;
    for (int64_t c0 = 0; c0 < d; c0 += 16) {
        split16(load16(src, c0, d, valid), parts[0], parts[1], parts[2]);
        const int64_t pair = c0 / 32, half = (c0 / 16) & 1;
        for (int p = 0; p < 3; ++p) {
            uint16_t *tile = out + ((pair * key_blocks + kb) * 3 * 2 + p * 2 + half) * TILE_ELEMS;
            for (int c = 0; c < 16; ++c) tile[r * 32 + c * 2 + e] = parts[p][c];
        }
    }
}

/* One task: a block of up to 32 new tokens of one sequence under one query head. cost: the key
   blocks it reads (its work grows with them). */
typedef struct { int64_t seq, head, t0, cost; } prefill_task_t;

/* A sequence's keys rounded up to whole blocks of 32: the packed K and V hold this many. */
static inline int64_t keys_padded(int64_t keys) { return (keys + 31) / 32 * 32; }

/* Sequence by sequence, and within a sequence longest first: a sequence's packed keys stay in the
   core's cache while its blocks run (taking the longest of all sequences first instead cycled every
   sequence's keys through it: 5% slower at one thread on SmolLM2's shapes), and each sequence ends
   on its shortest blocks, so no long block starts last while the other threads wait for it. The
   rest of the order only makes the list the same from run to run (a task's bits do not depend on
   it). */
static int by_sequence_longest_first(const void *a, const void *b) {
    const prefill_task_t *x = (const prefill_task_t *)a, *y = (const prefill_task_t *)b;
    if (x->seq != y->seq) return x->seq < y->seq ? -1 : 1;
    if (x->cost != y->cost) return x->cost > y->cost ? -1 : 1;
    if (x->head != y->head) return x->head < y->head ? -1 : 1;
    return x->t0 < y->t0 ? -1 : x->t0 > y->t0;
}

/* Attention of the new tokens of n_seqs sequences over their keys, in one parallel region. Sequence
   s is rows[4 s .. 4 s + 3] = (its first token in q and out, its row of block_tables, its new tokens,
   its context): tokens at positions context .. context + tokens - 1, keys 0 .. context + tokens - 1
   read through that row of block_tables from caches [blocks, block_size, kv_heads, head_dim]. q and
   out: token t, head h at t * stride + h * head_dim. Workspaces: k_ws and v_ws hold every sequence's
   kv_heads x keys_pad x head_dim x 3 bfloat16, one sequence after another; thread_ws n_threads x
   per_thread bytes, per_thread sized for the longest sequence. Returns 0, or -1 when the task list
   could not be allocated (nothing computed). */
int amx_prefill_attention(const float *q, int64_t q_stride, int64_t n_seqs, const int64_t *rows,
                          const int32_t *block_tables, int64_t table_stride, const float *key_cache,
                          const float *value_cache, int64_t block_size, int64_t kv_heads, int64_t group,
                          int64_t head_dim, float scale, float *out, int64_t out_stride, uint16_t *k_ws,
                          uint16_t *v_ws, uint8_t *thread_ws, int64_t per_thread, int64_t n_threads) {
    const int64_t d_blocks = head_dim / 32, heads = kv_heads * group;
    int64_t n_tasks = 0, max_keys_pad = 32;
    for (int64_t s = 0; s < n_seqs; ++s) {
        const int64_t keys_pad = keys_padded(rows[4 * s + 3] + rows[4 * s + 2]);
        n_tasks += heads * ((rows[4 * s + 2] + 31) / 32);
        if (keys_pad > max_keys_pad) max_keys_pad = keys_pad;
    }
    prefill_task_t *tasks = (prefill_task_t *)malloc((size_t)(n_tasks > 0 ? n_tasks : 1) * sizeof(prefill_task_t));
    int64_t *ws_at = (int64_t *)malloc((size_t)(n_seqs > 0 ? n_seqs : 1) * sizeof(int64_t));
    if (!tasks || !ws_at) { free(tasks); free(ws_at); return -1; }
    int64_t at = 0, k = 0;
    for (int64_t s = 0; s < n_seqs; ++s) {
        const int64_t tokens = rows[4 * s + 2], context = rows[4 * s + 3];
        ws_at[s] = at;
        at += kv_heads * keys_padded(context + tokens) * head_dim * 3;
        for (int64_t head = 0; head < heads; ++head)
            for (int64_t t0 = 0; t0 < tokens; t0 += 32) {
                const int64_t seen = context + t0 + (tokens - t0 < 32 ? tokens - t0 : 32);
                tasks[k].seq = s; tasks[k].head = head; tasks[k].t0 = t0; tasks[k].cost = (seen + 31) / 32;
                ++k;
            }
    }
    qsort(tasks, (size_t)n_tasks, sizeof(prefill_task_t), by_sequence_longest_first);
    #pragma omp parallel num_threads(n_threads)
    {
        /* 1. Every sequence's K and V out of the cache, packed; the threads share each sequence's
           keys and go on to the next one without waiting, then wait once for all of them. */
        for (int64_t s = 0; s < n_seqs; ++s) {
            const int64_t keys = rows[4 * s + 3] + rows[4 * s + 2], keys_pad = keys_padded(keys);
            const int64_t key_blocks = keys_pad / 32, head_elems = keys_pad * head_dim * 3;
            const int32_t *block_table = block_tables + rows[4 * s + 1] * table_stride;
            uint16_t *k_seq = k_ws + ws_at[s], *v_seq = v_ws + ws_at[s];
            #pragma omp for schedule(static) collapse(2) nowait
            for (int64_t h = 0; h < kv_heads; ++h)
                for (int64_t j = 0; j < keys_pad; ++j) {
                    const int valid = j < keys;
                    const int64_t slot = valid ? (int64_t)block_table[j / block_size] * block_size + j % block_size : 0;
                    const int64_t at_key = (slot * kv_heads + h) * head_dim;
                    pack_column(key_cache + at_key, head_dim, valid, j, d_blocks, k_seq + h * head_elems);
                    pack_value(value_cache + at_key, head_dim, valid, j, key_blocks, v_seq + h * head_elems);
                }
        }
        #pragma omp barrier
#ifdef _OPENMP
        uint8_t *mine = thread_ws + omp_get_thread_num() * per_thread;
#else
        uint8_t *mine = thread_ws;
#endif
        uint16_t *q_split = (uint16_t *)mine;
        float *scores = (float *)(mine + d_blocks * BLOCK_ELEMS * 2);
        uint16_t *p_split = (uint16_t *)(scores + 32 * max_keys_pad);
        float *acc = (float *)(p_split + (max_keys_pad / 32) * BLOCK_ELEMS);
        float sums[32];
        configure_tiles();
        /* 2. The tasks of all sequences, by sequence and longest first within one, taken as they come. */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t i_task = 0; i_task < n_tasks; ++i_task) {
            const prefill_task_t *task = &tasks[i_task];
            const int64_t s = task->seq, head = task->head, t0 = task->t0, kv = head / group;
            const int64_t tokens = rows[4 * s + 2], context = rows[4 * s + 3];
            const int64_t keys_pad = keys_padded(context + tokens), key_blocks = keys_pad / 32;
            const int64_t head_elems = keys_pad * head_dim * 3;
            const float *q_seq = q + rows[4 * s] * q_stride;
            float *out_seq = out + rows[4 * s] * out_stride;
            const uint16_t *k_head = k_ws + ws_at[s] + kv * head_elems, *v_head = v_ws + ws_at[s] + kv * head_elems;
            const int64_t n_rows = tokens - t0 < 32 ? tokens - t0 : 32;
            const int64_t blocks = task->cost;  /* key blocks the token block can see */
            for (int64_t i = 0; i < 32; ++i)
                split_row(q_seq + (t0 + i) * q_stride + head * head_dim, head_dim, i < n_rows, 0, i, d_blocks, q_split);
            for (int64_t b = 0; b < blocks; ++b)
                block_32x32(q_split, k_head + b * d_blocks * BLOCK_ELEMS, 0, d_blocks, scores + b * 32, keys_pad, 1);
            for (int64_t i = 0; i < 32; ++i) {
                float *row = scores + i * keys_pad;
                sums[i] = softmax_numerators(row, i < n_rows ? context + t0 + i + 1 : 0, blocks * 32, scale);
                split_row(row, blocks * 32, 1, 0, i, blocks, p_split);
            }
            for (int64_t b = 0; b < d_blocks; ++b)
                block_32x32(p_split, v_head + b * key_blocks * BLOCK_ELEMS, 0, blocks, acc + b * 32, head_dim, 1);
            for (int64_t i = 0; i < n_rows; ++i) {
                float *dst = out_seq + (t0 + i) * out_stride + head * head_dim;
                for (int64_t c = 0; c < head_dim; ++c) dst[c] = acc[i * head_dim + c] / sums[i];
            }
        }
        _tile_release();
    }
    free(tasks);
    free(ws_at);
    return 0;
}

AMX_TARGET_END
