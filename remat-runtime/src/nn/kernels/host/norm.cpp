// Runs norm.cu's kernels on host threads (see shim.h; blocks of one warp):
// reads i64 rows, c, dtype (0 f32, 1 f16, 2 bf16), layer, f64 eps, then x,
// gain, bias, dy (elements of the dtype) from argv[1]; writes y (the
// dtype), then f32 mean, rstd, dx, and the per-chunk column sums of the
// gain's and the bias's gradients, to argv[2].
#include <cstdio>
#include <thread>
#include <vector>

#include "../norm.cu"

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
      pthread_barrier_init(&warp_barriers[0], nullptr, 32);
      std::vector<std::thread> threads;
      for (unsigned t = 0; t < 32; t++)
        threads.emplace_back([=] {
          threadIdx = {t, 0, 0};
          kernel();
        });
      for (auto &th : threads) th.join();
      pthread_barrier_destroy(&warp_barriers[0]);
    }
}

template <typename T> int run(FILE *in, FILE *out, int rows, int c, int layer, float eps) {
  long long n = (long long)rows * c;
  std::vector<T> x(n), gain(c), bias(c), dy(n), y(n);
  if (fread(x.data(), sizeof(T), n, in) != (size_t)n ||
      fread(gain.data(), sizeof(T), c, in) != (size_t)c ||
      fread(bias.data(), sizeof(T), c, in) != (size_t)c ||
      fread(dy.data(), sizeof(T), n, in) != (size_t)n)
    return 3;
  int chunks = (rows + NORM_CHUNK - 1) / NORM_CHUNK;
  std::vector<float> mean(rows), rstd(rows), dx(n), dg((long long)chunks * c), db((long long)chunks * c);
  // One warp (block) per row; the columns 32 to a block.
  grid(rows, 1, [&] {
    norm_forward<T>(rows, c, x.data(), gain.data(), bias.data(), eps, layer, y.data(), mean.data(),
                    rstd.data());
  });
  grid(rows, 1, [&] {
    norm_backward_dx<T>(rows, c, x.data(), gain.data(), dy.data(), mean.data(), rstd.data(), layer,
                        dx.data());
  });
  grid((c + 31) / 32, chunks, [&] {
    norm_backward_columns<T>(rows, c, x.data(), dy.data(), mean.data(), rstd.data(), dg.data(),
                             db.data());
  });
  fwrite(y.data(), sizeof(T), n, out);
  fwrite(mean.data(), 4, rows, out);
  fwrite(rstd.data(), 4, rows, out);
  fwrite(dx.data(), 4, n, out);
  fwrite(dg.data(), 4, dg.size(), out);
  fwrite(db.data(), 4, db.size(), out);
  return 0;
}

int main(int argc, char **argv) {
  if (argc != 3) return 2;
  FILE *in = fopen(argv[1], "rb"), *out = fopen(argv[2], "wb");
  if (!in || !out) return 2;
  long long head[4];
  double eps;
  if (fread(head, 8, 4, in) != 4 || fread(&eps, 8, 1, in) != 1) return 3;
  int rows = head[0], c = head[1], layer = head[3], rc = 4;
  if (head[2] == 0) rc = run<float>(in, out, rows, c, layer, (float)eps);
  if (head[2] == 1) rc = run<__half>(in, out, rows, c, layer, (float)eps);
  if (head[2] == 2) rc = run<bf16_t>(in, out, rows, c, layer, (float)eps);
  fclose(out);
  return rc;
}
