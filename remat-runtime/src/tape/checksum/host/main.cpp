// Runs checksum.cu's kernels on host threads (see shim.h) over each file
// named on the command line and prints each checksum as four 64-bit words
// in hex, one line per file. A file: the kernel's dtype name (8 bytes,
// NUL-padded), then u64 n, u64 num_dims, num_dims dims, num_dims strides
// (strides of 0 dims: contiguous), u64 start offset, u64 bytes, the bytes.
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>


#include "../checksum.cu"

thread_local Index threadIdx;
Index blockIdx;
pthread_barrier_t block_barrier;

// Runs `kernel` as one block of LANES threads (block index c), the threads
// meeting at the barrier for each __syncthreads.
template <typename F> void run_block(size_t c, F kernel) {
  blockIdx.x = (unsigned)c;
  pthread_barrier_init(&block_barrier, nullptr, LANES);
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < LANES; t++) {
    threads.emplace_back([=] {
      threadIdx.x = t;
      kernel();
    });
  }
  for (auto &th : threads) th.join();
  pthread_barrier_destroy(&block_barrier);
}

template <typename T>
void launch_partials(void (*kernel)(size_t, size_t, const size_t *, const T *, double *),
                     size_t chunks, size_t n, size_t num_dims, const size_t *info, const T *src,
                     double *out) {
  for (size_t c = 0; c < chunks; c++) run_block(c, [=] { kernel(n, num_dims, info, src, out); });
}

int main(int argc, char **argv) {
  for (int i = 1; i < argc; i++) {
    FILE *f = fopen(argv[i], "rb");
    if (!f) return 2;
    char name[9] = {0};
    uint64_t n, num_dims, offset, bytes;
    if (fread(name, 1, 8, f) != 8 || fread(&n, 8, 1, f) != 1 || fread(&num_dims, 8, 1, f) != 1)
      return 3;
    std::vector<size_t> info(2 * num_dims);
    if (num_dims && fread(info.data(), 8, 2 * num_dims, f) != 2 * num_dims) return 3;
    if (fread(&offset, 8, 1, f) != 1 || fread(&bytes, 8, 1, f) != 1) return 3;
    std::vector<uint8_t> data(bytes + 8);
    if (bytes && fread(data.data(), 1, bytes, f) != bytes) return 3;
    fclose(f);
    // Contiguous: no dims and strides, as candle passes them.
    const size_t *dims = num_dims ? info.data() : nullptr;
    size_t chunks = (n + CHUNK - 1) / CHUNK;
    std::vector<double> partials(chunks * PARTIAL), out(4, 0.0);
    std::string kind(name);
#define CASE(NAME, T)                                                                              \
  if (kind == #NAME)                                                                               \
    launch_partials<T>(checksum_partials_##NAME, chunks, n, num_dims, dims,                        \
                       reinterpret_cast<const T *>(data.data()) + offset, partials.data());
    CASE(f32, float)
    CASE(f16, __half)
    CASE(bf16, Bf16)
    CASE(f64, double)
    CASE(u8, uint8_t)
    CASE(u32, uint32_t)
    CASE(i16, int16_t)
    CASE(i32, int32_t)
    CASE(i64, int64_t)
    double *p = partials.data(), *o = out.data();
    if (n > 0) run_block(0, [=] { checksum_combine(chunks, p, o); });
    uint64_t w[4];
    std::memcpy(w, out.data(), 32);
    printf("%016" PRIx64 " %016" PRIx64 " %016" PRIx64 " %016" PRIx64 "\n", w[0], w[1], w[2], w[3]);
  }
  return 0;
}
