// What attention.cu (f32 on the SIMT units) and attention_tc.cu (f16 and
// bf16 on tensor cores) share: the sizes and strides of a call and the
// causal rule.
#pragma once
#include "elements.cuh"

// Sizes and strides every kernel takes, by value.
struct Shape {
  int h, hkv, t, s, d, dv, causal, has_mask;
  float scale;
  long long q_b, q_h, q_t;
  long long k_b, k_h, k_s;
  long long v_b, v_h, v_s;
  long long m_b, m_h, m_t, m_s;
  long long o_b, o_t, o_h;
  long long g_b, g_t, g_h;  // dout
  // Where the backward writes dq, dk and dv: an offset in elements, then
  // the strides of (b, head, row); the features contiguous.
  long long dq_o, dq_b, dq_h, dq_t;
  long long dk_o, dk_b, dk_h, dk_s;
  long long dv_o, dv_b, dv_h, dv_s;
};

// Keys 0..keys_for(i) are visible to query i.
__device__ __forceinline__ int keys_for(const Shape &p, int i) {
  if (!p.causal) return p.s;
  int n = i + p.s - p.t + 1;
  return n < p.s ? n : p.s;
}
