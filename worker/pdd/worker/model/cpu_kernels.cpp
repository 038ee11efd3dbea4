// The engine's CPU kernels (AVX-512): attention over the paged KV cache, and the fused
// row-wise ops of a decoder layer (residual add + RMSNorm, SiLU-and-mul, RoPE with the
// write of the new K and V into the cache).
//
// Why attention is here: every query token of a step (a decode's one, a prefill
// chunk's many) attends over its own sequence's keys in the paged cache, read in place
// through the block table, up to its own position (which is the causal mask). One task
// is one (query token, KV head): the query heads that share a KV head read each key
// and value row once; scores, softmax and the weighted sum of values are fp32. Against
// the eager path this removes the gather copy, the padding and masks of attention
// groups, and SDPA's per-call overhead (about 30 us per sequence and layer for a
// decode over a few hundred keys, four times what reading those keys takes). And since
// a token's result depends only on its own sequence's keys and position, it is the same
// bits whether the token is decoded, prefilled in a chunk, recomputed after a handoff,
// or batched with anything else.
//
// Why the row-wise ops are here: each is five to eight separate torch ops (and as many
// passes over memory and dispatches) in eager mode, which a decode step of a few rows
// pays per layer. Fused, each is one pass, with the same roundings as the eager ops
// (fp32 inside, rounded to the model's dtype where the eager op rounds), row by row, so
// a row's result does not depend on the other rows.
//
// Built at setup (or on first use) by pdd/worker/model/cpu_kernels.py, which falls
// back to torch's own ops wherever this file cannot be compiled or does not apply.

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__) || \
    !defined(__AVX512DQ__)
#error "cpu_kernels.cpp needs AVX-512 (F, BW, VL, DQ); the caller falls back to torch's ops"
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

// x rounded to bf16 (nearest even, as c10::BFloat16's conversion does; NaN stays NaN),
// as fp32 bit patterns whose low 16 bits are to be dropped.
inline __m512i bf16_rounded_bits(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc00000));
}

inline void store16(at::BFloat16* p, __m512 x) {
  const __m512i top = _mm512_srli_epi32(bf16_rounded_bits(x), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(top));
}

// One query head held in registers, dotted with key rows: an unreduced 16-lane fp32
// sum per row. bf16 with AVX512-BF16: dot products of bf16 pairs straight from memory
// (exact products, fp32 sums), half the instructions of widening first; otherwise each
// row is widened to fp32 and multiplied there.
template <typename T, int NC>
struct QueryHead {
  __m512 q[NC];
  explicit QueryHead(const T* head) {
    for (int c = 0; c < NC; ++c) q[c] = load16(head + c * kLanes);
  }
  __m512 dot(const T* row) const {
    __m512 sum = _mm512_mul_ps(q[0], load16(row));
    for (int c = 1; c < NC; ++c) sum = _mm512_fmadd_ps(q[c], load16(row + c * kLanes), sum);
    return sum;
  }
};
#if defined(__AVX512BF16__)
template <int NC>
  requires(NC % 2 == 0)
struct QueryHead<at::BFloat16, NC> {
  __m512bh q[NC / 2];
  explicit QueryHead(const at::BFloat16* head) {
    for (int c = 0; c < NC / 2; ++c)
      q[c] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(head + c * 2 * kLanes));
  }
  __m512 dot(const at::BFloat16* row) const {
    __m512 sum = _mm512_setzero_ps();
    for (int c = 0; c < NC / 2; ++c)
      sum = _mm512_dpbf16_ps(sum, q[c], reinterpret_cast<__m512bh>(_mm512_loadu_si512(row + c * 2 * kLanes)));
    return sum;
  }
};
#endif

// r[j] = the sum of v[j]'s 16 lanes, for 16 vectors at once: a transpose-and-add tree of
// 45 instructions where 16 separate horizontal sums take about 130.
inline __m512 sum_each(const __m512 (&v)[kLanes]) {
  __m512 a[8], b[4];
  for (int k = 0; k < 8; ++k)  // per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3]
    a[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]),
                         _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; ++k)  // per 128-bit lane: that lane's sums of v[4k .. 4k+3]
    b[k] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * k], a[2 * k + 1], 0x44),
                         _mm512_shuffle_ps(a[2 * k], a[2 * k + 1], 0xEE));
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x44),
                                  _mm512_shuffle_f32x4(b[0], b[1], 0xEE));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x44),
                                  _mm512_shuffle_f32x4(b[2], b[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88), _mm512_shuffle_f32x4(d0, d1, 0xDD));
}

// out[g] = sum over t of p[g][t] v[t], for query heads [g0, g0 + GC): the accumulators
// stay in registers (16 / NC heads at a time), so each token costs FMAs, not stores.
template <typename T, int NC, int GC>
void weigh_values(const T* v_head, const int64_t* table, int64_t L, int64_t block_size,
                  const float* scores, const float* inverse, int64_t g0, T* out) {
  constexpr int64_t D = kLanes * NC;
  __m512 acc[GC][NC];
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < NC; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t t0 = 0, blk = 0; t0 < L; t0 += block_size, ++blk) {
    const int64_t n = std::min(block_size, L - t0);
    const T* rows = v_head + table[blk] * block_size * D;
    for (int64_t i = 0; i < n; ++i) {
      __m512 value[NC];
      for (int c = 0; c < NC; ++c) value[c] = load16(rows + i * D + c * kLanes);
      for (int g = 0; g < GC; ++g) {
        const __m512 p = _mm512_set1_ps(scores[(g0 + g) * L + t0 + i]);
        for (int c = 0; c < NC; ++c) acc[g][c] = _mm512_fmadd_ps(p, value[c], acc[g][c]);
      }
    }
  }
  for (int g = 0; g < GC; ++g) {
    const __m512 inv = _mm512_set1_ps(inverse[g0 + g]);
    for (int c = 0; c < NC; ++c) store16(out + (g0 + g) * D + c * kLanes, _mm512_mul_ps(acc[g][c], inv));
  }
}

// One task: the G query heads of one KV head of one sequence. D = 16 * NC.
// q: [G, D] of this task; k_head, v_head: this KV head's [slots, D] rows;
// table: the sequence's block ids; scores: [G, L] and inverse: [G] scratch.
template <typename T, int NC>
void attend_one(const T* q, const T* k_head, const T* v_head, const int64_t* table, int64_t L,
                int64_t block_size, int64_t G, float scale, float* scores, float* inverse,
                T* out) {
  constexpr int64_t D = kLanes * NC;

  // Scores, 16 keys at a time: each query head is dotted with the 16 rows (L1-resident
  // after the first head), and the 16 sums are reduced together.
  const T* rows[kLanes];
  for (int64_t t0 = 0; t0 < L; t0 += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, L - t0);
    for (int64_t j = 0, blk = t0 / block_size, off = t0 % block_size; j < n; ++j) {
      rows[j] = k_head + (table[blk] * block_size + off) * D;
      if (++off == block_size) off = 0, ++blk;
    }
    for (int64_t g = 0; g < G; ++g) {
      const QueryHead<T, NC> head(q + g * D);
      __m512 dots[kLanes];
      for (int j = 0; j < kLanes; ++j) dots[j] = j < n ? head.dot(rows[j]) : _mm512_setzero_ps();
      const __m512 r = _mm512_mul_ps(sum_each(dots), _mm512_set1_ps(scale));
      _mm512_mask_storeu_ps(scores + g * L + t0, static_cast<__mmask16>((1u << n) - 1), r);
    }
  }

  // Softmax per query head, fp32, with Sleef's 1-ulp exp.
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores + g * L;
    const float top = at::vec::reduce_all<float>(
        [](fVec& a, fVec& b) { return at::vec::maximum(a, b); }, s, L);
    at::vec::map([top](fVec x) { return (x - fVec(top)).exp(); }, s, s, L);
    inverse[g] = 1.f / at::vec::reduce_all<float>([](fVec& a, fVec& b) { return a + b; }, s, L);
  }

  // Weighted sum of values, a few query heads at a time.
  constexpr int kHeadsAtOnce = std::max(1, std::min(4, 16 / NC));
  for (int64_t g0 = 0; g0 < G; g0 += kHeadsAtOnce) {
    const int64_t heads = std::min<int64_t>(kHeadsAtOnce, G - g0);
    if (heads == kHeadsAtOnce) {
      weigh_values<T, NC, kHeadsAtOnce>(v_head, table, L, block_size, scores, inverse, g0, out);
    } else {
      for (int64_t g = g0; g < g0 + heads; ++g)
        weigh_values<T, NC, 1>(v_head, table, L, block_size, scores, inverse, g, out);
    }
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
    std::vector<float> inverse(G), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / H, h = task % H, L = lp[b];
      if (static_cast<int64_t>(scores.size()) < G * L) scores.resize(G * L);
      attend_one<T, NC>(qp + b * q_row + h * G * D, kp + h * slots * D, vp + h * slots * D,
                        tp + b * width, L, block_size, G, static_cast<float>(scale),
                        scores.data(), inverse.data(), op + task * G * D);
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

// q: [B, Hkv, G, D], one row per query token (G query heads per KV head), contiguous
// but for its first dim (the queries are a slice of the fused QKV projection's output).
// kv: one layer of the cache, [2, Hkv, slots, D] (K then V), contiguous.
// tables: [B, blocks] int64, each row's sequence's block ids; lens: [B] int64, the keys
// each row sees (>= 1). Returns [B, Hkv, G, D] in q's dtype.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& tables,
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

namespace {

// Masked 16-lane load / store of the first n (< 16) elements: rows of any length.
inline __m512 load_n(const float* p, int64_t n) {
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
}
inline __m512 load_n(const at::BFloat16* p, int64_t n) {
  const __m256i raw = _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
template <typename T>
inline void store_n(T* p, __m512 x, int64_t n) {
  alignas(64) T tmp[kLanes];
  store16(tmp, x);
  std::memcpy(p, tmp, n * sizeof(T));
}
// What storing x in T and reading it back gives (the eager ops' intermediate rounding),
// without leaving the register.
inline __m512 round_to(float*, __m512 x) { return x; }
inline __m512 round_to(at::BFloat16*, __m512 x) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  return _mm512_castsi512_ps(_mm512_and_si512(bf16_rounded_bits(x), high));
}

// Apply f(chunk index, lanes) over a row of n elements, 16 at a time, the tail masked.
template <typename F>
inline void over_row(int64_t n, F f) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) f(i, kLanes);
  if (i < n) f(i, n - i);
}
template <typename T>
inline __m512 load_any(const T* p, int64_t lanes) { return lanes == kLanes ? load16(p) : load_n(p, lanes); }
template <typename T>
inline void store_any(T* p, __m512 x, int64_t lanes) {
  if (lanes == kLanes) store16(p, x); else store_n(p, x, lanes);
}

// out = weight * T(x * rsqrt(mean(x^2) + eps)), x's squares summed in fp32.
template <typename T>
void rms_norm_row(const T* x, const T* weight, float eps, int64_t n, T* out) {
  __m512 squares = _mm512_setzero_ps();
  over_row(n, [&](int64_t i, int64_t lanes) {
    const __m512 v = load_any(x + i, lanes);
    squares = _mm512_fmadd_ps(v, v, squares);
  });
  const float inv = 1.f / std::sqrt(_mm512_reduce_add_ps(squares) / static_cast<float>(n) + eps);
  const __m512 scale = _mm512_set1_ps(inv);
  over_row(n, [&](int64_t i, int64_t lanes) {
    const __m512 normed = round_to(static_cast<T*>(nullptr), _mm512_mul_ps(load_any(x + i, lanes), scale));
    store_any(out + i, _mm512_mul_ps(load_any(weight + i, lanes), normed), lanes);
  });
}

inline int64_t grain_for(int64_t row) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(row, 1)); }

template <typename T>
void rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps, const at::Tensor& residual,
                   at::Tensor& out) {
  const int64_t n = x.size(-1), rows = x.numel() / n;
  const T* xp = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* rp = residual.defined() ? residual.data_ptr<T>() : nullptr;
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, grain_for(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = xp + r * n;
      if (rp != nullptr) {  // residual += x, rounded to T as the eager add rounds
        T* res = rp + r * n;
        over_row(n, [&](int64_t i, int64_t lanes) {
          store_any(res + i, _mm512_add_ps(load_any(res + i, lanes), load_any(row + i, lanes)), lanes);
        });
        row = res;
      }
      rms_norm_row(row, wp, static_cast<float>(eps), n, op + r * n);
    }
  });
}

// out = T(silu(gate)) * up over gate_up = [gate | up] per row, as F.silu(gate) * up rounds.
template <typename T>
void silu_and_mul_rows(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t n = out.size(-1), rows = out.numel() / n;
  const T* gp = gate_up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const __m512 one = _mm512_set1_ps(1.f);
  at::parallel_for(0, rows, grain_for(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = gp + r * 2 * n;
      const T* up = gate + n;
      over_row(n, [&](int64_t i, int64_t lanes) {
        const __m512 g = load_any(gate + i, lanes);
        const __m512 e = fVec(_mm512_sub_ps(_mm512_setzero_ps(), g)).exp();
        const __m512 silu = round_to(static_cast<T*>(nullptr), _mm512_div_ps(g, _mm512_add_ps(one, e)));
        store_any(op + r * n + i, _mm512_mul_ps(silu, load_any(up + i, lanes)), lanes);
      });
    }
  });
}

void check_rows(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and weight dtypes differ");
  TORCH_CHECK(weight.dim() == 1 && x.size(-1) == weight.size(0), "weight does not fit x's rows");
}

template <typename F>
void by_dtype(at::ScalarType type, F f) {
  if (type == at::kBFloat16) return f(static_cast<at::BFloat16*>(nullptr));
  TORCH_CHECK(type == at::kFloat, "cpu kernels: bf16 or fp32 only");
  f(static_cast<float*>(nullptr));
}

}  // namespace

// RMSNorm of every row of x (the last dim), as the eager RMSNorm computes it.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, weight);
  at::Tensor out = at::empty_like(x);
  by_dtype(x.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rms_norm_rows<T>(x, weight, eps, at::Tensor(), out);
  });
  return out;
}

// residual += x (in place, rounded to the dtype), then RMSNorm of the new residual.
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_rows(x, weight);
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == x.sizes() &&
                  residual.scalar_type() == x.scalar_type(), "residual does not fit x");
  at::Tensor out = at::empty_like(x);
  by_dtype(x.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rms_norm_rows<T>(x, weight, eps, residual, out);
  });
  return out;
}

// silu(gate) * up for gate_up = [..., 2 * n] (gate first): [..., n].
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.size(-1) % 2 == 0, "gate_up must be contiguous, even");
  auto sizes = gate_up.sizes().vec();
  sizes.back() /= 2;
  at::Tensor out = at::empty(sizes, gate_up.options());
  by_dtype(gate_up.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    silu_and_mul_rows<T>(gate_up, out);
  });
  return out;
}

namespace {

// Rotary embedding of one head ("rotate half": [x1, x2] -> [x1 c - x2 s, x2 c + x1 s]),
// rounding after every product and sum as the eager ops do in the model's dtype.
template <typename T>
inline void rotate_head(const T* x, const T* cos, const T* sin, int64_t half, T* out) {
  T* tag = nullptr;
  over_row(half, [&](int64_t i, int64_t lanes) {
    const __m512 x1 = load_any(x + i, lanes), x2 = load_any(x + half + i, lanes);
    const __m512 c = load_any(cos + i, lanes), s = load_any(sin + i, lanes);
    const __m512 a = _mm512_sub_ps(round_to(tag, _mm512_mul_ps(x1, c)), round_to(tag, _mm512_mul_ps(x2, s)));
    const __m512 b = _mm512_add_ps(round_to(tag, _mm512_mul_ps(x2, c)), round_to(tag, _mm512_mul_ps(x1, s)));
    store_any(out + i, a, lanes);
    store_any(out + half + i, b, lanes);
  });
}

template <typename T>
void rope_rows(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& kv,
               const at::Tensor& slots, int64_t heads, int64_t kv_heads, at::Tensor& q_out) {
  const int64_t rows = qkv.size(0), D = kv.size(3), half = D / 2, cache_slots = kv.size(2);
  const int64_t row = qkv.size(1);
  const T* xp = qkv.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  T* kp = kv.data_ptr<T>();
  T* vp = kp + kv_heads * cache_slots * D;
  T* qp = q_out.data_ptr<T>();
  at::parallel_for(0, rows, grain_for(row), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* x = xp + t * row;
      const T* c = cp + t * half;
      const T* s = sp + t * half;
      for (int64_t h = 0; h < heads; ++h) rotate_head(x + h * D, c, s, half, qp + (t * heads + h) * D);
      for (int64_t h = 0; h < kv_heads; ++h) {
        const int64_t at = (h * cache_slots + slot[t]) * D;
        rotate_head(x + (heads + h) * D, c, s, half, kp + at);
        std::memcpy(vp + at, x + (heads + kv_heads + h) * D, D * sizeof(T));
      }
    }
  });
}

}  // namespace

// The step's new tokens, from the fused QKV projection's output [T, (H + 2 Hkv) * D]:
// RoPE on q and k (cos, sin: [T, D / 2] in the model's dtype), k and v written to this
// layer's cache ([2, Hkv, slots, D]) at each token's slot. Returns the rotated q
// [T, H, D]; the attention then reads k and v from the cache.
at::Tensor rope_and_cache(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                          at::Tensor& kv, const at::Tensor& slots, int64_t heads) {
  TORCH_CHECK(qkv.dim() == 2 && kv.dim() == 4 && kv.size(0) == 2, "bad qkv / kv shapes");
  const int64_t kv_heads = kv.size(1), D = kv.size(3);
  TORCH_CHECK(D % 2 == 0 && qkv.size(1) == (heads + 2 * kv_heads) * D, "qkv does not fit kv");
  TORCH_CHECK(qkv.is_contiguous() && kv.is_contiguous() && cos.is_contiguous() &&
                  sin.is_contiguous() && slots.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(cos.size(0) == qkv.size(0) && cos.size(1) == D / 2 && sin.sizes() == cos.sizes(),
              "cos / sin must be [T, D / 2]");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type() &&
                  kv.scalar_type() == qkv.scalar_type(), "dtypes differ");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == qkv.size(0), "slots: [T] int64");
  at::Tensor q = at::empty({qkv.size(0), heads, D}, qkv.options());
  by_dtype(qkv.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rope_rows<T>(qkv, cos, sin, kv, slots, heads, kv_heads, q);
  });
  return q;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "Attention of query tokens over the paged KV cache");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim");
  m.def("add_rms_norm", &add_rms_norm, "residual += x, then RMSNorm of residual");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up");
  m.def("rope_and_cache", &rope_and_cache, "RoPE on q and k, k and v into the cache");
}
