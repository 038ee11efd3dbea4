// Decode attention over the paged KV cache on an AVX-512 CPU: one query token per
// sequence, keys and values read in place through the block table.
//
// Why it exists: on the CPU, SDPA costs about 30 us per sequence and layer for a few
// hundred keys (a per-call overhead and small-matrix GEMMs), four times what reading
// those keys from memory takes, and the padded alternative must first gather the keys
// into a copy. This kernel runs one (sequence, KV head) pair per task across the
// torch thread pool: the query heads that share a KV head read each key and value
// row once, converted to fp32 in registers; scores, softmax and the weighted sum of
// values are all fp32. Each task depends only on its own sequence's keys, so a
// sequence's output does not depend on what else is in the batch.
//
// Built at setup (or on first use) by pdd/worker/model/paged_attention.py, which falls
// back to SDPA wherever this file cannot be compiled or does not apply.

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__) || \
    !defined(__AVX512DQ__)
#error "paged_attention.cpp needs AVX-512 (F, BW, VL, DQ); the caller falls back to SDPA"
#endif
#define CPU_CAPABILITY_AVX512
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

using fVec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = 16;  // floats per AVX-512 register

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load16(const at::BFloat16* p) {
  // bf16 is the top half of an fp32: widen and shift, exactly.
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }

inline void store16(at::BFloat16* p, __m512 x) {
  // Round to nearest even, as c10::BFloat16's conversion does (NaN stays NaN).
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(rounded));
}

// One task: the G query heads of one KV head of one sequence. D = 16 * NC.
// q: [G, D] of this task; k_head, v_head: this KV head's [slots, D] rows;
// table: the sequence's block ids; scores: [G, L] scratch; acc: [G, D] scratch.
template <typename T, int NC>
void attend_one(const T* q, const T* k_head, const T* v_head, const int64_t* table, int64_t L,
                int64_t block_size, int64_t G, float scale, float* qf, float* scores,
                float* acc, T* out) {
  constexpr int64_t D = kLanes * NC;
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c)
      store16(qf + g * D + c * kLanes, _mm512_mul_ps(load16(q + g * D + c * kLanes), sc));

  // Scores: each key row is widened once and dotted with every query head.
  for (int64_t t0 = 0, blk = 0; t0 < L; t0 += block_size, ++blk) {
    const int64_t n = std::min(block_size, L - t0);
    const T* rows = k_head + table[blk] * block_size * D;
    for (int64_t i = 0; i < n; ++i) {
      __m512 key[NC];
      for (int c = 0; c < NC; ++c) key[c] = load16(rows + i * D + c * kLanes);
      for (int64_t g = 0; g < G; ++g) {
        __m512 dot = _mm512_mul_ps(load16(qf + g * D), key[0]);
        for (int c = 1; c < NC; ++c) dot = _mm512_fmadd_ps(load16(qf + g * D + c * kLanes), key[c], dot);
        scores[g * L + t0 + i] = _mm512_reduce_add_ps(dot);
      }
    }
  }

  // Softmax per query head, fp32, with Sleef's 1-ulp exp.
  std::vector<float> inverse(G);
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores + g * L;
    const float top = at::vec::reduce_all<float>(
        [](fVec& a, fVec& b) { return at::vec::maximum(a, b); }, s, L);
    at::vec::map([top](fVec x) { return (x - fVec(top)).exp(); }, s, s, L);
    inverse[g] = 1.f / at::vec::reduce_all<float>([](fVec& a, fVec& b) { return a + b; }, s, L);
  }

  // Weighted sum of values: each value row is widened once for every query head.
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t t0 = 0, blk = 0; t0 < L; t0 += block_size, ++blk) {
    const int64_t n = std::min(block_size, L - t0);
    const T* rows = v_head + table[blk] * block_size * D;
    for (int64_t i = 0; i < n; ++i) {
      __m512 value[NC];
      for (int c = 0; c < NC; ++c) value[c] = load16(rows + i * D + c * kLanes);
      for (int64_t g = 0; g < G; ++g) {
        const __m512 p = _mm512_set1_ps(scores[g * L + t0 + i]);
        float* a = acc + g * D;
        for (int c = 0; c < NC; ++c)
          store16(a + c * kLanes, _mm512_fmadd_ps(p, value[c], load16(a + c * kLanes)));
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const __m512 inv = _mm512_set1_ps(inverse[g]);
    for (int c = 0; c < NC; ++c)
      store16(out + g * D + c * kLanes, _mm512_mul_ps(load16(acc + g * D + c * kLanes), inv));
  }
}

template <typename T, int NC>
void attend_all(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& tables,
                const at::Tensor& lens, int64_t block_size, double scale, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), G = q.size(2), D = q.size(3);
  const int64_t slots = kv.size(2), width = tables.size(1), q_row = q.stride(0);
  const T* qp = q.data_ptr<T>();
  const T* kp = kv.data_ptr<T>();
  const T* vp = kp + H * slots * D;
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / H, h = task % H, L = lp[b];
      if (static_cast<int64_t>(scores.size()) < G * L) scores.resize(G * L);
      attend_one<T, NC>(qp + b * q_row + h * G * D, kp + h * slots * D, vp + h * slots * D,
                        tp + b * width, L, block_size, G, static_cast<float>(scale), qf.data(),
                        scores.data(), acc.data(), op + task * G * D);
    }
  });
}

template <typename T>
void dispatch_head_dim(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& tables,
                       const at::Tensor& lens, int64_t block_size, double scale, at::Tensor& out) {
  switch (q.size(3) / kLanes) {
    case 1: return attend_all<T, 1>(q, kv, tables, lens, block_size, scale, out);
    case 2: return attend_all<T, 2>(q, kv, tables, lens, block_size, scale, out);
    case 4: return attend_all<T, 4>(q, kv, tables, lens, block_size, scale, out);
    case 5: return attend_all<T, 5>(q, kv, tables, lens, block_size, scale, out);
    case 6: return attend_all<T, 6>(q, kv, tables, lens, block_size, scale, out);
    case 8: return attend_all<T, 8>(q, kv, tables, lens, block_size, scale, out);
    case 16: return attend_all<T, 16>(q, kv, tables, lens, block_size, scale, out);
    default: TORCH_CHECK(false, "paged decode attention: unsupported head dim ", q.size(3));
  }
}

}  // namespace

// q: [B, Hkv, G, D] (G query heads per KV head), contiguous but for its first dim
// (a decode step's queries are a slice of the fused QKV projection's output).
// kv: one layer of the cache, [2, Hkv, slots, D] (K then V), contiguous.
// tables: [B, blocks] int64 block ids; lens: [B] int64 keys per sequence (>= 1).
// Returns [B, Hkv, G, D] in q's dtype.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& tables,
                            const at::Tensor& lens, int64_t block_size, double scale) {
  TORCH_CHECK(q.dim() == 4 && kv.dim() == 4 && kv.size(0) == 2, "bad q / kv shapes");
  TORCH_CHECK(q.stride(3) == 1 && q.stride(2) == q.size(3) &&
                  q.stride(1) == q.size(2) * q.size(3),
              "q must be contiguous within a sequence");
  TORCH_CHECK(kv.is_contiguous() && tables.is_contiguous() && lens.is_contiguous(),
              "kv, tables and lens must be contiguous");
  TORCH_CHECK(q.scalar_type() == kv.scalar_type(), "q and kv dtypes differ");
  TORCH_CHECK(tables.scalar_type() == at::kLong && lens.scalar_type() == at::kLong,
              "tables and lens must be int64");
  TORCH_CHECK(q.size(1) == kv.size(1) && q.size(3) == kv.size(3), "q does not fit kv");
  TORCH_CHECK(q.size(0) == tables.size(0) && q.size(0) == lens.size(0), "batch sizes differ");
  at::Tensor out = at::empty(q.sizes(), q.options());
  if (q.scalar_type() == at::kBFloat16) {
    dispatch_head_dim<at::BFloat16>(q, kv, tables, lens, block_size, scale, out);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kFloat, "paged decode attention: bf16 or fp32 only");
    dispatch_head_dim<float>(q, kv, tables, lens, block_size, scale, out);
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "Decode attention over the paged KV cache");
}
