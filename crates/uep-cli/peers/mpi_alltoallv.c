/*
 * The peer baseline of `uep bench --peers`: the expert-parallel exchange a user writes
 * without an EP library, as Megatron-LM's all-to-all token dispatcher does it, over
 * MPI_Alltoallv.
 *
 *   dispatch: count the tokens for each rank (a token goes once to every rank that
 *             holds one of its experts), exchange the counts (MPI_Alltoall), pack each
 *             token's row, top-k ids and weights by destination, MPI_Alltoallv.
 *             The received records, grouped by source rank in token order, are the
 *             output (as DeepEP's dispatch lays them out).
 *   combine:  every rank returns one bf16 row per received token (identity experts:
 *             the row it got), MPI_Alltoallv back, and the source sums each token's
 *             rows over the ranks in rank order in f32, rounded once to bf16 (uep's
 *             combine).
 *
 * Usage: uep-mpi-peer DIR ITERS WARMUP HIDDEN TOPK EXPERTS
 * Reads DIR/rank<r>/{x.bin (bf16 [T,H]), topk_idx.bin (i64 [T,K]), weights.bin
 * (f32 [T,K])}; writes DIR/rank<r>/combined.bin (bf16 [T,H], the last step's combine,
 * for checking against uep's reference) and, on rank 0, one JSON line: the mean over
 * ranks of each op's average time, and the bytes a rank sends (uep's accounting).
 */
#include <mpi.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void die(const char *what) {
    fprintf(stderr, "uep-mpi-peer: %s\n", what);
    MPI_Abort(MPI_COMM_WORLD, 2);
}

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) die("out of memory");
    return p;
}

static void *read_file(const char *dir, int rank, const char *name, size_t *len) {
    char path[4096];
    snprintf(path, sizeof path, "%s/rank%d/%s", dir, rank, name);
    FILE *f = fopen(path, "rb");
    if (!f) die(path);
    fseek(f, 0, SEEK_END);
    *len = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    void *buf = xmalloc(*len);
    if (*len && fread(buf, 1, *len, f) != *len) die(path);
    fclose(f);
    return buf;
}

static float bf16_to_f32(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Round to nearest even, as the `half` crate does (NaN kept quiet). */
static uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    uint32_t round = 0x7fffu + ((bits >> 16) & 1);
    return (uint16_t)((bits + round) >> 16);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, world;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    if (argc != 7) die("usage: uep-mpi-peer DIR ITERS WARMUP HIDDEN TOPK EXPERTS");
    const char *dir = argv[1];
    int iters = atoi(argv[2]), warmup = atoi(argv[3]);
    size_t h = (size_t)atol(argv[4]), k = (size_t)atol(argv[5]), e = (size_t)atol(argv[6]);
    if (iters < 1 || h == 0 || k == 0 || e % (size_t)world) die("bad arguments");
    size_t epr = e / (size_t)world;

    size_t xl, il, wl;
    uint16_t *x = read_file(dir, rank, "x.bin", &xl);
    int64_t *idx = read_file(dir, rank, "topk_idx.bin", &il);
    float *w = read_file(dir, rank, "weights.bin", &wl);
    size_t t_n = xl / (2 * h);
    if (il != t_n * k * 8 || wl != t_n * k * 4) die("inputs disagree on the token count");

    /* A record: the row, then K ids, then K weights. */
    size_t row = 2 * h, rec = row + k * 8 + k * 4;
    /* in_rank[t * world + r]: token t goes to rank r. */
    char *in_rank = xmalloc(t_n * (size_t)world);
    memset(in_rank, 0, t_n * (size_t)world);
    for (size_t t = 0; t < t_n; t++)
        for (size_t s = 0; s < k; s++)
            if (idx[t * k + s] >= 0) in_rank[t * world + (size_t)idx[t * k + s] / epr] = 1;

    int *send_n = xmalloc(sizeof(int) * world), *recv_n = xmalloc(sizeof(int) * world);
    int *scnt = xmalloc(sizeof(int) * world), *sdis = xmalloc(sizeof(int) * world);
    int *rcnt = xmalloc(sizeof(int) * world), *rdis = xmalloc(sizeof(int) * world);
    int *bscnt = xmalloc(sizeof(int) * world), *bsdis = xmalloc(sizeof(int) * world);
    int *brcnt = xmalloc(sizeof(int) * world), *brdis = xmalloc(sizeof(int) * world);
    size_t copies = 0;
    for (size_t t = 0; t < t_n; t++)
        for (int r = 0; r < world; r++) copies += in_rank[t * world + r];
    /* MPI_Alltoallv counts bytes in ints. */
    if (copies * rec > 2147483647u) die("more than 2 GiB to send: too large for MPI_Alltoallv's int counts");
    char *sendbuf = xmalloc(copies * rec);
    /* Row of each (token, rank) in the send buffer, for the combine's reduction. */
    size_t *slot = xmalloc(sizeof(size_t) * t_n * (size_t)world);
    uint16_t *combined = xmalloc(t_n * row);
    char *recvbuf = NULL, *ret = NULL, *backbuf = xmalloc(copies * row);
    float *acc = xmalloc(sizeof(float) * h);
    double t_dispatch = 0, t_combine = 0;

    for (int step = 0; step < warmup + iters; step++) {
        /* ---- dispatch ---- */
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = MPI_Wtime();
        for (int r = 0; r < world; r++) send_n[r] = 0;
        for (size_t t = 0; t < t_n; t++)
            for (int r = 0; r < world; r++) send_n[r] += in_rank[t * world + r];
        MPI_Alltoall(send_n, 1, MPI_INT, recv_n, 1, MPI_INT, MPI_COMM_WORLD);
        size_t total_recv = 0, off = 0;
        for (int r = 0; r < world; r++) {
            scnt[r] = (int)(send_n[r] * rec);
            sdis[r] = (int)off;
            off += (size_t)scnt[r];
            rcnt[r] = (int)(recv_n[r] * rec);
            rdis[r] = (int)(total_recv * rec);
            total_recv += (size_t)recv_n[r];
        }
        /* Pack by destination, token order. */
        size_t fill[world];
        for (int r = 0; r < world; r++) fill[r] = (size_t)sdis[r] / rec;
        for (size_t t = 0; t < t_n; t++)
            for (int r = 0; r < world; r++) {
                if (!in_rank[t * world + r]) continue;
                size_t at = fill[r]++;
                slot[t * world + r] = at;
                char *p = sendbuf + at * rec;
                memcpy(p, x + t * h, row);
                memcpy(p + row, idx + t * k, k * 8);
                memcpy(p + row + k * 8, w + t * k, k * 4);
            }
        /* The same inputs every step: the buffers are sized once. */
        if (step == 0) recvbuf = xmalloc(total_recv * rec + 1);
        MPI_Alltoallv(sendbuf, scnt, sdis, MPI_BYTE, recvbuf, rcnt, rdis, MPI_BYTE, MPI_COMM_WORLD);
        double t1 = MPI_Wtime();

        /* ---- the experts (not timed, as in uep bench): identity, each received row
         * into a contiguous output, as an expert's output tensor would be ---- */
        if (step == 0) ret = xmalloc(total_recv * row + 1);
        for (size_t i = 0; i < total_recv; i++) memcpy(ret + i * row, recvbuf + i * rec, row);

        /* ---- combine ---- */
        MPI_Barrier(MPI_COMM_WORLD);
        double t2 = MPI_Wtime();
        for (int r = 0; r < world; r++) {
            bscnt[r] = (int)(recv_n[r] * row);
            bsdis[r] = rdis[r] / (int)rec * (int)row;
            brcnt[r] = (int)(send_n[r] * row);
            brdis[r] = sdis[r] / (int)rec * (int)row;
        }
        MPI_Alltoallv(ret, bscnt, bsdis, MPI_BYTE, backbuf, brcnt, brdis, MPI_BYTE, MPI_COMM_WORLD);
        for (size_t t = 0; t < t_n; t++) {
            memset(acc, 0, sizeof(float) * h);
            for (int r = 0; r < world; r++) {
                if (!in_rank[t * world + r]) continue;
                const uint16_t *y = (const uint16_t *)(backbuf + slot[t * world + r] * row);
                for (size_t c = 0; c < h; c++) acc[c] += bf16_to_f32(y[c]);
            }
            for (size_t c = 0; c < h; c++) combined[t * h + c] = f32_to_bf16(acc[c]);
        }
        double t3 = MPI_Wtime();
        if (step >= warmup) {
            t_dispatch += t1 - t0;
            t_combine += t3 - t2;
        }
    }

    char path[4096];
    snprintf(path, sizeof path, "%s/rank%d/combined.bin", dir, rank);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(combined, 1, t_n * row, f) != t_n * row) die(path);
    fclose(f);

    /* uep's byte accounting: a row per (token, destination rank). */
    double mine[3] = {t_dispatch / iters * 1e6, t_combine / iters * 1e6, (double)(copies * row)};
    double sum[3];
    MPI_Reduce(mine, sum, 3, MPI_DOUBLE, MPI_SUM, 0, MPI_COMM_WORLD);
    if (rank == 0)
        printf("{\"ranks\": %d, \"dispatch_us\": %.3f, \"combine_us\": %.3f, \"bytes_per_rank\": %.0f}\n",
               world, sum[0] / world, sum[1] / world, sum[2] / world);
    MPI_Finalize();
    return 0;
}
