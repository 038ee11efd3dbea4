// The engine's CPU kernels: attention over the paged KV cache, and the fused row-wise
// ops of a decoder layer (residual add + RMSNorm, SiLU-and-mul, RoPE with the write of
// the new K and V into the cache). One source for two vector widths: compiled with
// AVX-512 (F, BW, VL, DQ; AVX512-BF16's dot products where enabled) it works on 16
// floats at a time, with AVX2 + FMA + F16C on 8; only the thin layer below differs.
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
// Built at setup (or on first use) by pdd/worker/model/cpu_kernels.py, once per variant
// (the compiler flags choose the width), which falls back to torch's own ops wherever
// this file cannot be compiled or does not apply.

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__)
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define CPU_CAPABILITY_AVX2
#else
#error "cpu_kernels.cpp needs AVX-512 (F, BW, VL, DQ) or AVX2 with FMA and F16C"
#endif
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

// ---- The vector-width layer: everything below is written once against it. ----------
// Vf holds kLanes floats; bf16 is loaded widened to fp32 and stored rounded from it.
// The kernels never depend on the width for their numerics contract (fp32 inside,
// rounded where the eager ops round); only the order of fp32 sums differs by width.

using fVec = at::vec::Vectorized<float>;

#if defined(CPU_CAPABILITY_AVX512)
using Vf = __m512;
using Vi = __m512i;
constexpr int64_t kLanes = 16;    // floats per register
constexpr int kRegisters = 32;    // vector registers (zmm0-31)

inline Vf vzero() { return _mm512_setzero_ps(); }
inline Vf vset(float x) { return _mm512_set1_ps(x); }
inline Vf vadd(Vf a, Vf b) { return _mm512_add_ps(a, b); }
inline Vf vsub(Vf a, Vf b) { return _mm512_sub_ps(a, b); }
inline Vf vmul(Vf a, Vf b) { return _mm512_mul_ps(a, b); }
inline Vf vdiv(Vf a, Vf b) { return _mm512_div_ps(a, b); }
inline Vf vfmadd(Vf a, Vf b, Vf c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c, one rounding
inline float vsum(Vf x) { return _mm512_reduce_add_ps(x); }

inline Vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vf vload(const at::BFloat16* p) {
  // bf16 is the top half of an fp32: widen and shift, exactly.
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline void vstore(float* p, Vf x) { _mm512_storeu_ps(p, x); }

// x rounded to bf16 (nearest even, as c10::BFloat16's conversion does; NaN stays NaN),
// as fp32 bit patterns whose low 16 bits are to be dropped.
inline Vi bf16_rounded_bits(Vf x) {
  const Vi bits = _mm512_castps_si512(x);
  const Vi lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const Vi rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc00000));
}
inline void vstore(at::BFloat16* p, Vf x) {
  const Vi top = _mm512_srli_epi32(bf16_rounded_bits(x), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(top));
}
inline Vf keep_high_halves(Vi bits) {
  return _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

// The first n (< kLanes) elements, masked: rows of any length.
inline Vf vload_n(const float* p, int64_t n) {
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
}
inline Vf vload_n(const at::BFloat16* p, int64_t n) {
  const __m256i raw = _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline void vstore_n(float* p, Vf x, int64_t n) {
  _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), x);
}

// r[j] = the sum of v[j]'s 16 lanes, for 16 vectors at once: a transpose-and-add tree of
// 45 instructions where 16 separate horizontal sums take about 130.
inline Vf sum_each(const Vf (&v)[kLanes]) {
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

#else  // AVX2 + FMA + F16C
using Vf = __m256;
using Vi = __m256i;
constexpr int64_t kLanes = 8;     // floats per register
constexpr int kRegisters = 16;    // vector registers (ymm0-15)

inline Vf vzero() { return _mm256_setzero_ps(); }
inline Vf vset(float x) { return _mm256_set1_ps(x); }
inline Vf vadd(Vf a, Vf b) { return _mm256_add_ps(a, b); }
inline Vf vsub(Vf a, Vf b) { return _mm256_sub_ps(a, b); }
inline Vf vmul(Vf a, Vf b) { return _mm256_mul_ps(a, b); }
inline Vf vdiv(Vf a, Vf b) { return _mm256_div_ps(a, b); }
inline Vf vfmadd(Vf a, Vf b, Vf c) { return _mm256_fmadd_ps(a, b, c); }  // a * b + c, one rounding
inline float vsum(Vf x) {
  const __m128 quad = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  const __m128 pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}

inline Vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vf vload(const at::BFloat16* p) {
  // bf16 is the top half of an fp32: widen and shift, exactly.
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline void vstore(float* p, Vf x) { _mm256_storeu_ps(p, x); }

// x rounded to bf16 (nearest even, as c10::BFloat16's conversion does; NaN stays NaN),
// as fp32 bit patterns whose low 16 bits are to be dropped.
inline Vi bf16_rounded_bits(Vf x) {
  const Vi bits = _mm256_castps_si256(x);
  const Vi lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const Vi rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  return _mm256_castps_si256(_mm256_blendv_ps(
      _mm256_castsi256_ps(rounded), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)), nan));
}
inline void vstore(at::BFloat16* p, Vf x) {
  const Vi top = _mm256_srli_epi32(bf16_rounded_bits(x), 16);  // each in [0, 0xffff]
  const __m128i packed =
      _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
inline Vf keep_high_halves(Vi bits) {
  return _mm256_castsi256_ps(_mm256_and_si256(bits, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

// The first n (< kLanes) elements, through a zeroed buffer: rows of any length.
template <typename T>
inline Vf vload_n(const T* p, int64_t n) {
  alignas(32) T tmp[kLanes] = {};
  std::memcpy(tmp, p, n * sizeof(T));
  return vload(tmp);
}
inline void vstore_n(float* p, Vf x, int64_t n) {
  alignas(32) float tmp[kLanes];
  vstore(tmp, x);
  std::memcpy(p, tmp, n * sizeof(float));
}

// r[j] = the sum of v[j]'s 8 lanes, for 8 vectors at once: a transpose-and-add tree.
inline Vf sum_each(const Vf (&v)[kLanes]) {
  __m256 a[4], b[2];
  for (int k = 0; k < 4; ++k)  // per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3]
    a[k] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * k], v[2 * k + 1]),
                         _mm256_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 2; ++k)  // per 128-bit lane: that lane's sums of v[4k .. 4k+3]
    b[k] = _mm256_add_ps(_mm256_shuffle_ps(a[2 * k], a[2 * k + 1], 0x44),
                         _mm256_shuffle_ps(a[2 * k], a[2 * k + 1], 0xEE));
  // b[0] = [v0..v3 low halves' sums | v0..v3 high halves' sums]; likewise b[1] for v4..v7
  return _mm256_add_ps(_mm256_permute2f128_ps(b[0], b[1], 0x20),
                       _mm256_permute2f128_ps(b[0], b[1], 0x31));
}
#endif

inline void vstore_n(at::BFloat16* p, Vf x, int64_t n) {
  alignas(64) at::BFloat16 tmp[kLanes];
  vstore(tmp, x);
  std::memcpy(p, tmp, n * sizeof(at::BFloat16));
}

// ---- The kernels. ---------------------------------------------------------------------

// One query head held in registers, dotted with key rows: an unreduced kLanes-wide fp32
// sum per row. bf16 with AVX512-BF16: dot products of bf16 pairs straight from memory
// (exact products, fp32 sums), half the instructions of widening first; otherwise each
// row is widened to fp32 and multiplied there.
template <typename T, int NC>
struct QueryHead {
  Vf q[NC];
  explicit QueryHead(const T* head) {
    for (int c = 0; c < NC; ++c) q[c] = vload(head + c * kLanes);
  }
  Vf dot(const T* row) const {
    Vf sum = vmul(q[0], vload(row));
    for (int c = 1; c < NC; ++c) sum = vfmadd(q[c], vload(row + c * kLanes), sum);
    return sum;
  }
};
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
template <int NC>
  requires(NC % 2 == 0)
struct QueryHead<at::BFloat16, NC> {
  __m512bh q[NC / 2];
  explicit QueryHead(const at::BFloat16* head) {
    for (int c = 0; c < NC / 2; ++c)
      q[c] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(head + c * 2 * kLanes));
  }
  Vf dot(const at::BFloat16* row) const {
    Vf sum = vzero();
    for (int c = 0; c < NC / 2; ++c)
      sum = _mm512_dpbf16_ps(sum, q[c], reinterpret_cast<__m512bh>(_mm512_loadu_si512(row + c * 2 * kLanes)));
    return sum;
  }
};
#endif

// out[g] = sum over t of p[g][t] v[t], for query heads [g0, g0 + GC): the accumulators
// stay in registers (half the register file's worth of heads at a time, at most 4), so
// each token costs FMAs, not stores.
template <typename T, int NC, int GC>
void weigh_values(const T* v_head, const int64_t* table, int64_t L, int64_t block_size,
                  const float* scores, const float* inverse, int64_t g0, T* out) {
  constexpr int64_t D = kLanes * NC;
  Vf acc[GC][NC];
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < NC; ++c) acc[g][c] = vzero();
  for (int64_t t0 = 0, blk = 0; t0 < L; t0 += block_size, ++blk) {
    const int64_t n = std::min(block_size, L - t0);
    const T* rows = v_head + table[blk] * block_size * D;
    for (int64_t i = 0; i < n; ++i) {
      Vf value[NC];
      for (int c = 0; c < NC; ++c) value[c] = vload(rows + i * D + c * kLanes);
      for (int g = 0; g < GC; ++g) {
        const Vf p = vset(scores[(g0 + g) * L + t0 + i]);
        for (int c = 0; c < NC; ++c) acc[g][c] = vfmadd(p, value[c], acc[g][c]);
      }
    }
  }
  for (int g = 0; g < GC; ++g) {
    const Vf inv = vset(inverse[g0 + g]);
    for (int c = 0; c < NC; ++c) vstore(out + (g0 + g) * D + c * kLanes, vmul(acc[g][c], inv));
  }
}

// One task: the G query heads of one KV head of one sequence. D = kLanes * NC.
// q: [G, D] of this task; k_head, v_head: this KV head's [slots, D] rows;
// table: the sequence's block ids; scores: [G, L] and inverse: [G] scratch.
template <typename T, int NC>
void attend_one(const T* q, const T* k_head, const T* v_head, const int64_t* table, int64_t L,
                int64_t block_size, int64_t G, float scale, float* scores, float* inverse,
                T* out) {
  constexpr int64_t D = kLanes * NC;

  // Scores, kLanes keys at a time: each query head is dotted with those rows
  // (L1-resident after the first head), and their sums are reduced together.
  const T* rows[kLanes];
  for (int64_t t0 = 0; t0 < L; t0 += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, L - t0);
    for (int64_t j = 0, blk = t0 / block_size, off = t0 % block_size; j < n; ++j) {
      rows[j] = k_head + (table[blk] * block_size + off) * D;
      if (++off == block_size) off = 0, ++blk;
    }
    for (int64_t g = 0; g < G; ++g) {
      const QueryHead<T, NC> head(q + g * D);
      Vf dots[kLanes];
      for (int j = 0; j < kLanes; ++j) dots[j] = j < n ? head.dot(rows[j]) : vzero();
      const Vf r = vmul(sum_each(dots), vset(scale));
      if (n == kLanes) vstore(scores + g * L + t0, r); else vstore_n(scores + g * L + t0, r, n);
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
  constexpr int kHeadsAtOnce = std::max(1, std::min(4, (kRegisters / 2) / NC));
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

// The (sequence, KV head) tasks cut into at most `runs` contiguous runs of about equal
// work, as the bounds of each run (first task, ..., B * H). A task's work grows with its
// sequence's length, so an even split by count left one thread waiting while the other
// finished the long sequences of a mixed batch. Which thread runs a task never changes
// its arithmetic, so the results stay bit-identical.
std::vector<int64_t> balanced_runs(const int64_t* lens, int64_t B, int64_t H, int64_t runs) {
  constexpr int64_t kTaskOverhead = 16;  // keys' worth of fixed cost per task
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) total += H * (lens[b] + kTaskOverhead);
  runs = std::max<int64_t>(1, std::min(runs, B * H));
  std::vector<int64_t> bounds{0};
  int64_t done = 0;
  for (int64_t task = 0; task < B * H; ++task) {
    done += lens[task / H] + kTaskOverhead;
    const int64_t cut = static_cast<int64_t>(bounds.size());  // the next run's index
    if (cut < runs && done * runs >= total * cut) bounds.push_back(task + 1);
  }
  if (bounds.back() != B * H) bounds.push_back(B * H);
  return bounds;
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
  const std::vector<int64_t> bounds = balanced_runs(lp, B, H, at::get_num_threads());
  at::parallel_for(0, static_cast<int64_t>(bounds.size()) - 1, 1, [&](int64_t first, int64_t last) {
    std::vector<float> inverse(G), scores;
    for (int64_t task = bounds[first]; task < bounds[last]; ++task) {
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
  switch (q.size(3)) {  // the head dims cpu_kernels.py lists (HEAD_DIMS)
    case 16: return attend_all<T, 16 / kLanes>(q, kv, tables, lens, block_size, scale, out);
    case 32: return attend_all<T, 32 / kLanes>(q, kv, tables, lens, block_size, scale, out);
    case 64: return attend_all<T, 64 / kLanes>(q, kv, tables, lens, block_size, scale, out);
    case 80: return attend_all<T, 80 / kLanes>(q, kv, tables, lens, block_size, scale, out);
    case 96: return attend_all<T, 96 / kLanes>(q, kv, tables, lens, block_size, scale, out);
    case 128: return attend_all<T, 128 / kLanes>(q, kv, tables, lens, block_size, scale, out);
    case 256: return attend_all<T, 256 / kLanes>(q, kv, tables, lens, block_size, scale, out);
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

// What storing x in T and reading it back gives (the eager ops' intermediate rounding),
// without leaving the register.
inline Vf round_to(float*, Vf x) { return x; }
inline Vf round_to(at::BFloat16*, Vf x) { return keep_high_halves(bf16_rounded_bits(x)); }

// Apply f(chunk index, lanes) over a row of n elements, kLanes at a time, then the tail.
template <typename F>
inline void over_row(int64_t n, F f) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) f(i, kLanes);
  if (i < n) f(i, n - i);
}
template <typename T>
inline Vf load_any(const T* p, int64_t lanes) { return lanes == kLanes ? vload(p) : vload_n(p, lanes); }
template <typename T>
inline void store_any(T* p, Vf x, int64_t lanes) {
  if (lanes == kLanes) vstore(p, x); else vstore_n(p, x, lanes);
}

// out = weight * T(x * rsqrt(mean(x^2) + eps)), x's squares summed in fp32.
template <typename T>
void rms_norm_row(const T* x, const T* weight, float eps, int64_t n, T* out) {
  Vf squares = vzero();
  over_row(n, [&](int64_t i, int64_t lanes) {
    const Vf v = load_any(x + i, lanes);
    squares = vfmadd(v, v, squares);
  });
  const float inv = 1.f / std::sqrt(vsum(squares) / static_cast<float>(n) + eps);
  const Vf scale = vset(inv);
  over_row(n, [&](int64_t i, int64_t lanes) {
    const Vf normed = round_to(static_cast<T*>(nullptr), vmul(load_any(x + i, lanes), scale));
    store_any(out + i, vmul(load_any(weight + i, lanes), normed), lanes);
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
          store_any(res + i, vadd(load_any(res + i, lanes), load_any(row + i, lanes)), lanes);
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
  const Vf one = vset(1.f);
  at::parallel_for(0, rows, grain_for(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = gp + r * 2 * n;
      const T* up = gate + n;
      over_row(n, [&](int64_t i, int64_t lanes) {
        const Vf g = load_any(gate + i, lanes);
        const Vf e = fVec(vsub(vzero(), g)).exp();
        const Vf silu = round_to(static_cast<T*>(nullptr), vdiv(g, vadd(one, e)));
        store_any(op + r * n + i, vmul(silu, load_any(up + i, lanes)), lanes);
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
    const Vf x1 = load_any(x + i, lanes), x2 = load_any(x + half + i, lanes);
    const Vf c = load_any(cos + i, lanes), s = load_any(sin + i, lanes);
    const Vf a = vsub(round_to(tag, vmul(x1, c)), round_to(tag, vmul(x2, s)));
    const Vf b = vadd(round_to(tag, vmul(x2, c)), round_to(tag, vmul(x1, s)));
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
