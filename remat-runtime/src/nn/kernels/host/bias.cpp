// Runs bias.cu's kernels on the host (see shim.h; no barrier, so each
// block's threads run one after another): reads i64 rows, n, dtype (0 f32,
// 1 f16, 2 bf16), then y (rows x n) and b (n) from argv[1]; writes y + b
// (the dtype) and the per-chunk column sums of y (f32) to argv[2].
#include <cstdio>
#include <vector>

#include "../bias.cu"

thread_local Index threadIdx;
Index blockIdx, gridDim;
pthread_barrier_t block_barrier;
pthread_barrier_t warp_barriers[32];
float shuffle_slots[32][32];

template <typename F> void grid(unsigned gx, unsigned gy, F kernel) {
  gridDim = {gx, gy, 1};
  for (unsigned y = 0; y < gy; y++)
    for (unsigned x = 0; x < gx; x++) {
      blockIdx = {x, y, 0};
      for (unsigned t = 0; t < blockDim.x; t++) {
        threadIdx = {t, 0, 0};
        kernel();
      }
    }
}

template <typename T> int run(FILE *in, FILE *out, int rows, int n) {
  long long len = (long long)rows * n;
  std::vector<T> y(len), b(n);
  if (fread(y.data(), sizeof(T), len, in) != (size_t)len ||
      fread(b.data(), sizeof(T), n, in) != (size_t)n)
    return 3;
  unsigned chunks = (rows + BIAS_CHUNK - 1) / BIAS_CHUNK, blocks = (n + 31) / 32;
  std::vector<float> sums((long long)chunks * n);
  // The sums of y as it came, then y + b.
  grid(blocks, chunks, [&] { column_sums<T>(rows, n, y.data(), sums.data()); });
  grid(blocks, chunks, [&] { bias_add<T>(rows, n, y.data(), b.data()); });
  fwrite(y.data(), sizeof(T), len, out);
  fwrite(sums.data(), 4, sums.size(), out);
  return 0;
}

int main(int argc, char **argv) {
  if (argc != 3) return 2;
  FILE *in = fopen(argv[1], "rb"), *out = fopen(argv[2], "wb");
  if (!in || !out) return 2;
  long long head[3];
  if (fread(head, 8, 3, in) != 3) return 3;
  int rc = 4;
  if (head[2] == 0) rc = run<float>(in, out, head[0], head[1]);
  if (head[2] == 1) rc = run<__half>(in, out, head[0], head[1]);
  if (head[2] == 2) rc = run<bf16_t>(in, out, head[0], head[1]);
  fclose(out);
  return rc;
}
