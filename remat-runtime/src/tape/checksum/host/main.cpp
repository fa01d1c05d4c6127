// Runs checksum.cu's kernels on host threads (see shim.h) over each file
// named on the command line and prints each checksum as four 64-bit words
// in hex, one line per file. A file: the kernel's dtype name (8 bytes,
// NUL-padded), then u64 n, u64 num_dims, num_dims dims, num_dims strides
// (strides of 0 dims: contiguous), u64 start offset, u64 bytes, the bytes.
// With `--packed`, one launch of the batch kernels over a parameter as the
// Rust launcher packs it.
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

// A value read from a file.
struct Loaded {
  std::string kind;
  uint64_t n, num_dims, offset;
  std::vector<size_t> info;
  std::vector<uint8_t> data;
};

static bool load(const char *path, Loaded &v) {
  FILE *f = fopen(path, "rb");
  if (!f) return false;
  char name[9] = {0};
  uint64_t bytes;
  if (fread(name, 1, 8, f) != 8 || fread(&v.n, 8, 1, f) != 1 || fread(&v.num_dims, 8, 1, f) != 1)
    return false;
  v.info.resize(2 * v.num_dims);
  if (v.num_dims && fread(v.info.data(), 8, 2 * v.num_dims, f) != 2 * v.num_dims) return false;
  if (fread(&v.offset, 8, 1, f) != 1 || fread(&bytes, 8, 1, f) != 1) return false;
  v.data.resize(bytes + 8);
  if (bytes && fread(v.data.data(), 1, bytes, f) != bytes) return false;
  fclose(f);
  v.kind = name;
  return true;
}

static void print(const double *words) {
  uint64_t w[4];
  std::memcpy(w, words, 32);
  printf("%016" PRIx64 " %016" PRIx64 " %016" PRIx64 " %016" PRIx64 "\n", w[0], w[1], w[2], w[3]);
}

// Runs one launch of the batch kernels over `b` (its values' chunks,
// then a block per value) and prints each member's checksum, in order.
static void run_batch(const std::string &kind, const Batch &b, size_t slots) {
  size_t chunks = 0;
  for (size_t i = 0; i < b.count; i++) chunks += (b.values[i].n + CHUNK - 1) / CHUNK;
  std::vector<double> partials(chunks * PARTIAL + 1), out(slots * WORDS, -1.0);
  double *p = partials.data(), *o = out.data();
  for (size_t g = 0; g < chunks; g++) {
#define PACKED_CASE(NAME, T)                                                                       \
  if (kind == #NAME) run_block(g, [=, &b] { checksum_batch_partials_##NAME(b, p); });
    PACKED_CASE(f32, float)
    PACKED_CASE(f16, __half)
    PACKED_CASE(bf16, Bf16)
    PACKED_CASE(f64, double)
    PACKED_CASE(u8, uint8_t)
    PACKED_CASE(u32, uint32_t)
    PACKED_CASE(i16, int16_t)
    PACKED_CASE(i32, int32_t)
    PACKED_CASE(i64, int64_t)
  }
  for (size_t i = 0; i < b.count; i++) run_block(i, [=, &b] { checksum_batch_combine(b, p, o); });
  for (size_t i = 0; i < b.count; i++) print(out.data() + b.values[i].slot * WORDS);
}

// `--packed KIND PARAMETER BLOB`: the parameter of a launch as the Rust
// launcher packs it (its bytes), each value's address an offset into the
// blob's bytes; prints each member's checksum, in order.
static int packed(const char *kind, const char *parameter, const char *blob) {
  Batch b;
  FILE *f = fopen(parameter, "rb");
  if (!f || fread(&b, sizeof b, 1, f) != 1 || fgetc(f) != EOF) return 5;
  fclose(f);
  f = fopen(blob, "rb");
  if (!f) return 5;
  std::vector<uint8_t> bytes;
  for (int c; (c = fgetc(f)) != EOF;) bytes.push_back((uint8_t)c);
  fclose(f);
  size_t slots = 0;
  for (size_t i = 0; i < b.count; i++) {
    Value &v = b.values[i];
    if (v.n) v.src = bytes.data() + (size_t)v.src;
    if (v.slot + 1 > slots) slots = v.slot + 1;
  }
  run_batch(kind, b, slots);
  return 0;
}

int main(int argc, char **argv) {
  if (argc == 5 && std::string(argv[1]) == "--packed") return packed(argv[2], argv[3], argv[4]);
  for (int i = 1; i < argc; i++) {
    Loaded v;
    if (!load(argv[i], v)) return 3;
    // Contiguous: no dims and strides, as candle passes them.
    const size_t *dims = v.num_dims ? v.info.data() : nullptr;
    size_t n = v.n, num_dims = v.num_dims, chunks = (n + CHUNK - 1) / CHUNK;
    std::vector<double> partials(chunks * PARTIAL), out(4, 0.0);
    const std::string &kind = v.kind;
    const uint8_t *data = v.data.data();
    const uint64_t offset = v.offset;
#define CASE(NAME, T)                                                                              \
  if (kind == #NAME)                                                                               \
    launch_partials<T>(checksum_partials_##NAME, chunks, n, num_dims, dims,                        \
                       reinterpret_cast<const T *>(data) + offset, partials.data());
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
    print(out.data());
  }
  return 0;
}
