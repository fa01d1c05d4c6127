// Runs attention.cu's and attention_tc.cu's kernels on host threads (see
// shim.h): reads a case from argv[1], writes out, stats, dq, dk, dv to
// argv[2]. The case: i64 dtype (0 f32, 1 f16, 2 bf16 on attention.cu; 3
// f16, 4 bf16 on attention_tc.cu), i64 DM (64 or 128), i64 B, then the Shape's
// fields in order as i64 (scale as f64), then i64 offsets of q, k, v, mask,
// out-for-backward (unused: the forward's own), dout in the data, i64
// element count, the data (elements of the dtype).
#include <cstdio>
#include <thread>
#include <vector>

#include "../attention.cu"
#include "../attention_tc.cu"

thread_local Index threadIdx;
Index blockIdx, gridDim;
pthread_barrier_t block_barrier;
pthread_barrier_t warp_barriers[32];
float shuffle_slots[32][32];

template <typename F> void grid(unsigned gx, unsigned gy, unsigned gz, unsigned nt, F kernel) {
  gridDim = {gx, gy, gz};
  for (unsigned z = 0; z < gz; z++)
    for (unsigned y = 0; y < gy; y++)
      for (unsigned x = 0; x < gx; x++) {
        blockIdx = {x, y, z};
        pthread_barrier_init(&block_barrier, nullptr, nt);
        for (unsigned w = 0; w < nt / 32; w++) pthread_barrier_init(&warp_barriers[w], nullptr, 32);
        std::vector<std::thread> threads;
        for (unsigned t = 0; t < nt; t++)
          threads.emplace_back([=] {
            threadIdx = {t, 0, 0};
            kernel();
          });
        for (auto &th : threads) th.join();
        pthread_barrier_destroy(&block_barrier);
        for (unsigned w = 0; w < nt / 32; w++) pthread_barrier_destroy(&warp_barriers[w]);
      }
}

// Where the backward writes dq, dk and dv (into g): one packed (B, T, 3,
// H, D) buffer, as attention_qkv's gradient, where q, k and v have one
// shape (`packed` then holds it), else three contiguous tensors.
template <typename T> bool place(Shape &g, long long B, std::vector<T> &packed) {
  long long H = g.h, T_ = g.t, D = g.d;
  if (g.h == g.hkv && g.d == g.dv && g.t == g.s) {
    packed.assign(B * T_ * 3 * H * D, T{});
    long long row = 3 * H * D;
    g.dq_o = 0, g.dk_o = H * D, g.dv_o = 2 * H * D;
    g.dq_b = g.dk_b = g.dv_b = T_ * row;
    g.dq_h = g.dk_h = g.dv_h = D;
    g.dq_t = g.dk_s = g.dv_s = row;
    return true;
  }
  g.dq_o = g.dk_o = g.dv_o = 0;
  g.dq_b = H * T_ * D, g.dq_h = T_ * D, g.dq_t = D;
  g.dk_b = (long long)g.hkv * g.s * D, g.dk_h = (long long)g.s * D, g.dk_s = D;
  g.dv_b = (long long)g.hkv * g.s * g.dv, g.dv_h = (long long)g.s * g.dv, g.dv_s = g.dv;
  return false;
}

// dq, dk, dv contiguous from the packed buffer.
template <typename T>
void unpack(const Shape &g, long long B, const std::vector<T> &packed, std::vector<T> &dq,
            std::vector<T> &dk, std::vector<T> &dv) {
  long long H = g.h, T_ = g.t, D = g.d;
  for (long long b = 0; b < B; b++)
    for (long long h = 0; h < H; h++)
      for (long long t = 0; t < T_; t++)
        for (long long c = 0; c < D; c++) {
          long long at = ((b * H + h) * T_ + t) * D + c, from = b * g.dq_b + h * D + t * g.dq_t + c;
          dq[at] = packed[from];
          dk[at] = packed[from + g.dk_o];
          dv[at] = packed[from + g.dv_o];
        }
}

template <typename T, int DM> int run(FILE *in, FILE *out, long long B, Shape p) {
  long long off[6], n;
  if (fread(off, 8, 6, in) != 6 || fread(&n, 8, 1, in) != 1) return 3;
  std::vector<T> data(n);
  if (n && fread(data.data(), sizeof(T), n, in) != (size_t)n) return 3;
  const T *q = data.data() + off[0], *k = data.data() + off[1], *v = data.data() + off[2];
  const T *mask = p.has_mask ? data.data() + off[3] : nullptr, *dout = data.data() + off[5];
  long long bht = B * p.h * p.t;
  std::vector<T> o(bht * p.dv), dq(bht * p.d), dk(B * p.hkv * p.s * p.d), dv(B * p.hkv * p.s * p.dv);
  std::vector<float> stats(2 * bht), delta(bht);
  unsigned rows = (p.t + NT - 1) / NT, keys = (p.s + NT - 1) / NT;
  grid(rows, p.h, B, NT, [&] { attention_forward<T, DM>(q, k, v, mask, o.data(), stats.data(), p); });
  // The backward reads the output as (B, T, H, Dv), contiguous.
  Shape g = p;
  g.o_b = (long long)p.t * p.h * p.dv, g.o_t = (long long)p.h * p.dv, g.o_h = p.dv;
  std::vector<T> packed;
  bool one = place(g, B, packed);
  T *pq = one ? packed.data() : dq.data(), *pk = one ? packed.data() : dk.data(),
    *pv = one ? packed.data() : dv.data();
  grid(rows, p.h, B, NT, [&] {
    attention_backward_dq<T, DM>(q, k, v, mask, o.data(), dout, stats.data(), pq, delta.data(), g);
  });
  grid(keys, p.hkv, B, NT, [&] {
    attention_backward_dkv<T, DM, true>(q, k, v, mask, dout, stats.data(), delta.data(), pk, g);
  });
  grid(keys, p.hkv, B, NT, [&] {
    attention_backward_dkv<T, DM, false>(q, k, v, mask, dout, stats.data(), delta.data(), pv, g);
  });
  if (one) unpack(g, B, packed, dq, dk, dv);
  fwrite(o.data(), sizeof(T), o.size(), out);
  fwrite(stats.data(), 4, stats.size(), out);
  fwrite(dq.data(), sizeof(T), dq.size(), out);
  fwrite(dk.data(), sizeof(T), dk.size(), out);
  fwrite(dv.data(), sizeof(T), dv.size(), out);
  return 0;
}

// The same case on attention_tc.cu's kernels.
template <typename T, int DM> int run_tc(FILE *in, FILE *out, long long B, Shape p) {
  long long off[6], n;
  if (fread(off, 8, 6, in) != 6 || fread(&n, 8, 1, in) != 1) return 3;
  std::vector<T> data(n);
  if (n && fread(data.data(), sizeof(T), n, in) != (size_t)n) return 3;
  const T *q = data.data() + off[0], *k = data.data() + off[1], *v = data.data() + off[2];
  const T *mask = p.has_mask ? data.data() + off[3] : nullptr, *dout = data.data() + off[5];
  long long bht = B * p.h * p.t;
  std::vector<T> o(bht * p.dv), dq(bht * p.d), dk(B * p.hkv * p.s * p.d), dv(B * p.hkv * p.s * p.dv);
  std::vector<float> stats(2 * bht), delta(bht);
  unsigned rows = (p.t + ROWS - 1) / ROWS, keys = (p.s + ROWS - 1) / ROWS, nt = 32 * WARPS;
  constexpr int BC = DM == 64 ? 64 : 32;
  grid(rows, p.h, B, nt, [&] { tc_forward<T, DM, BC>(q, k, v, mask, o.data(), stats.data(), p); });
  Shape g = p;
  g.o_b = (long long)p.t * p.h * p.dv, g.o_t = (long long)p.h * p.dv, g.o_h = p.dv;
  std::vector<T> packed;
  bool one = place(g, B, packed);
  T *pq = one ? packed.data() : dq.data(), *pk = one ? packed.data() : dk.data(),
    *pv = one ? packed.data() : dv.data();
  grid(rows, p.h, B, nt, [&] {
    tc_backward_dq<T, DM, 32>(q, k, v, mask, o.data(), dout, stats.data(), pq, delta.data(), g);
  });
  grid(keys, p.hkv, B, nt, [&] {
    tc_backward_dkv<T, DM, 32>(q, k, v, mask, dout, stats.data(), delta.data(), pk, pv, g);
  });
  if (one) unpack(g, B, packed, dq, dk, dv);
  fwrite(o.data(), sizeof(T), o.size(), out);
  fwrite(stats.data(), 4, stats.size(), out);
  fwrite(dq.data(), sizeof(T), dq.size(), out);
  fwrite(dk.data(), sizeof(T), dk.size(), out);
  fwrite(dv.data(), sizeof(T), dv.size(), out);
  return 0;
}

int main(int argc, char **argv) {
  if (argc != 3) return 2;
  FILE *in = fopen(argv[1], "rb"), *out = fopen(argv[2], "wb");
  if (!in || !out) return 2;
  long long head[3], f[8], st[19];
  double scale;
  if (fread(head, 8, 3, in) != 3 || fread(f, 8, 8, in) != 8 || fread(&scale, 8, 1, in) != 1 ||
      fread(st, 8, 19, in) != 19)
    return 3;
  Shape p;
  p.h = f[0], p.hkv = f[1], p.t = f[2], p.s = f[3], p.d = f[4], p.dv = f[5], p.causal = f[6],
  p.has_mask = f[7];
  p.scale = (float)scale;
  long long *s = st;
  p.q_b = s[0], p.q_h = s[1], p.q_t = s[2], p.k_b = s[3], p.k_h = s[4], p.k_s = s[5];
  p.v_b = s[6], p.v_h = s[7], p.v_s = s[8], p.m_b = s[9], p.m_h = s[10], p.m_t = s[11],
  p.m_s = s[12];
  p.o_b = s[13], p.o_t = s[14], p.o_h = s[15], p.g_b = s[16], p.g_t = s[17], p.g_h = s[18];
  int rc = 4;
  long long dtype = head[0], dm = head[1], B = head[2];
  if (dtype == 0 && dm == 64) rc = run<float, 64>(in, out, B, p);
  if (dtype == 0 && dm == 128) rc = run<float, 128>(in, out, B, p);
  if (dtype == 1 && dm == 64) rc = run<__half, 64>(in, out, B, p);
  if (dtype == 2 && dm == 64) rc = run<bf16_t, 64>(in, out, B, p);
  if (dtype == 3 && dm == 64) rc = run_tc<__half, 64>(in, out, B, p);
  if (dtype == 3 && dm == 128) rc = run_tc<__half, 128>(in, out, B, p);
  if (dtype == 4 && dm == 64) rc = run_tc<bf16_t, 64>(in, out, B, p);
  if (dtype == 4 && dm == 128) rc = run_tc<bf16_t, 128>(in, out, B, p);
  fclose(out);
  return rc;
}
