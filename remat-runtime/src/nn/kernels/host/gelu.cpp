// Runs gelu.cu's kernel on the host (see shim.h; it has no barrier, so its
// threads run one after another): reads u64 n, dtype (0 f32, 1 f16, 2 bf16),
// then x and dy (n elements each) from argv[1], writes out to argv[2].
#include <cstdio>
#include <vector>

#include "../gelu.cu"

thread_local Index threadIdx;
Index blockIdx, gridDim;
pthread_barrier_t block_barrier;

template <typename T, typename K> int run(FILE *in, FILE *out, size_t n, K kernel) {
  std::vector<T> x(n), dy(n), o(n);
  if (n && (fread(x.data(), sizeof(T), n, in) != n || fread(dy.data(), sizeof(T), n, in) != n)) return 3;
  // A grid smaller than n: the grid-stride loop covers the rest.
  gridDim = {3, 1, 1};
  for (unsigned b = 0; b < 3; b++)
    for (unsigned t = 0; t < 32; t++) {
      blockIdx = {b, 0, 0};
      threadIdx = {t, 0, 0};
      kernel(n, x.data(), dy.data(), o.data());
    }
  fwrite(o.data(), sizeof(T), n, out);
  return 0;
}

int main(int argc, char **argv) {
  if (argc != 3) return 2;
  FILE *in = fopen(argv[1], "rb"), *out = fopen(argv[2], "wb");
  unsigned long long head[2];
  if (!in || !out || fread(head, 8, 2, in) != 2) return 2;
  size_t n = head[0];
  int rc = 4;
  if (head[1] == 0) rc = run<float>(in, out, n, gelu_backward_f32);
  if (head[1] == 1) rc = run<__half>(in, out, n, gelu_backward_f16);
  if (head[1] == 2) rc = run<bf16_t>(in, out, n, gelu_backward_bf16);
  fclose(out);
  return rc;
}
