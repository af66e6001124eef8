// Paged attention on the CPU: an XLA FFI custom call that reads each sequence's K/V pages in place.
//
// XLA:CPU has no way to express "attend over the pages this table names" but a gather, which copies
// every live sequence's keys and values once per layer and step before the products read them again
// (at 32 decoding rows that copy was about half of the step). This kernel walks the page table
// itself, so the only K/V traffic is one read of the keys and one of the values a query can see.
// cpu_paged_attention.py compiles it on first use and registers it with jax; semantics are those of
// kernels/paged_attention.py (the Pallas kernel) and its reference:
//   q (B, L, H, K) at positions (B, L); pools (layers, N, T, G, K); table (B, P) of page ids; query
//   head h reads kv head h / (H / G); a query at position p sees keys j <= p, j > p - window when a
//   window is given, j < P * T; a negative position is a padding row and gets zeros. Scores are
//   soft-capped when softcap > 0; sinks (H,) join the softmax's denominator with no value.
// Work items are (row, token, block of kv heads): every query head of a kv head shares each key and
// value read, and a block reads its kv heads' keys of a position as one contiguous run. Items are
// split over XLA's intra-op thread pool; the call returns a future that completes when the last
// share is done.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Problem {
  const float* q;
  const float* k_pool;
  const float* v_pool;
  const int32_t* table;
  const int32_t* positions;
  const float* sinks;  // nullptr: no sinks
  float* out;
  int64_t B, L, H, K, N, T, G, P, layer;
  int64_t window;  // <= 0: none
  float scale, softcap;
};

inline float Dot(const float* a, const float* b, int64_t n) {
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

// One (row b, token l) and kv heads [g0, g0 + gn): their R = H / G query heads each over the keys
// position p sees. A position's keys for consecutive kv heads lie side by side in the pool, so
// each item reads one contiguous gn * K run per position: every byte it fetches is used.
void AttendItem(const Problem& pb, int64_t bl, int64_t g0, int64_t gn, std::vector<float>& scores) {
  const int64_t b = bl / pb.L, R = pb.H / pb.G, K = pb.K, T = pb.T, W = gn * R;  // W: query heads here
  const int64_t p = pb.positions[bl];
  const float* q = pb.q + (bl * pb.H + g0 * R) * K;  // head h = g * R + r: the W heads are contiguous
  float* out = pb.out + (bl * pb.H + g0 * R) * K;
  const float* sinks = pb.sinks ? pb.sinks + g0 * R : nullptr;
  const int64_t hi = std::min(p + 1, pb.P * T);
  const int64_t lo = pb.window > 0 ? std::max<int64_t>(0, p - pb.window + 1) : 0;
  if (p < 0 || hi <= lo) {
    std::fill(out, out + W * K, 0.0f);
    return;
  }
  const int64_t S = hi - lo;
  scores.resize(S * W + 2 * W);
  float* peak = scores.data() + S * W;
  float* total = peak + W;
  const int32_t* table = pb.table + b * pb.P;
  auto row = [&](const float* pool, int64_t j) {
    int64_t page = table[j / T];
    if (page < 0 || page >= pb.N) page = 0;  // out-of-range ids read the null page, never past the pool
    return pool + (((pb.layer * pb.N + page) * T + j % T) * pb.G + g0) * K;
  };
  // Scores, (S, W): each position's keys are loaded once for the R query heads of each kv head.
  for (int64_t j = lo; j < hi; ++j) {
    const float* k = row(pb.k_pool, j);
    float* s = scores.data() + (j - lo) * W;
    for (int64_t w = 0; w < W; ++w) {
      float x = Dot(q + w * K, k + (w / R) * K, K) * pb.scale;
      s[w] = pb.softcap > 0.0f ? pb.softcap * std::tanh(x / pb.softcap) : x;
    }
  }
  for (int64_t w = 0; w < W; ++w) {
    float m = sinks ? sinks[w] : -INFINITY;
    for (int64_t j = 0; j < S; ++j) m = std::max(m, scores[j * W + w]);
    peak[w] = m;
    total[w] = sinks ? std::exp(sinks[w] - m) : 0.0f;
  }
  for (int64_t j = 0; j < S; ++j) {
    for (int64_t w = 0; w < W; ++w) {
      float e = std::exp(scores[j * W + w] - peak[w]);
      scores[j * W + w] = e;
      total[w] += e;
    }
  }
  // Output: the weighted sum of the value rows, each loaded once.
  std::fill(out, out + W * K, 0.0f);
  for (int64_t j = lo; j < hi; ++j) {
    const float* v = row(pb.v_pool, j);
    const float* e = scores.data() + (j - lo) * W;
    for (int64_t w = 0; w < W; ++w) {
      float* o = out + w * K;
      const float* vg = v + (w / R) * K;
      const float ew = e[w];
#pragma omp simd
      for (int64_t i = 0; i < K; ++i) o[i] += ew * vg[i];
    }
  }
  for (int64_t w = 0; w < W; ++w) {
    const float inv = 1.0f / total[w];
    for (int64_t i = 0; i < K; ++i) out[w * K + i] *= inv;
  }
}

// Items are (row, token, block of kv heads): whole rows when there are enough of them to keep every
// thread busy, else each row's kv heads in `blocks` blocks.
void AttendRange(const Problem& pb, int64_t blocks, int64_t begin, int64_t end) {
  std::vector<float> scores;
  for (int64_t item = begin; item < end; ++item) {
    const int64_t bl = item / blocks, blk = item % blocks;
    const int64_t g0 = pb.G * blk / blocks, g1 = pb.G * (blk + 1) / blocks;
    AttendItem(pb, bl, g0, g1 - g0, scores);
  }
}

ffi::Future PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pool,
                               ffi::Buffer<ffi::F32> v_pool, ffi::Buffer<ffi::S32> table,
                               ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> layer_window,
                               ffi::Buffer<ffi::F32> sinks, ffi::ResultBuffer<ffi::F32> out, float scale,
                               float softcap) {
  auto qd = q.dimensions(), kd = k_pool.dimensions(), td = table.dimensions();
  Problem pb{q.typed_data(),     k_pool.typed_data(),    v_pool.typed_data(),
             table.typed_data(), positions.typed_data(), sinks.element_count() ? sinks.typed_data() : nullptr,
             out->typed_data(),  qd[0],                  qd[1],
             qd[2],              qd[3],                  kd[1],
             kd[2],              kd[3],                  td[1],
             // A traced layer index out of range is clamped, as XLA clamps a dynamic slice's start.
             std::clamp<int64_t>(layer_window.typed_data()[0], 0, kd[0] - 1),
             layer_window.typed_data()[1],
             scale,              softcap};
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t rows = pb.B * pb.L;
  const int64_t blocks = std::min(pb.G, (threads + rows - 1) / rows), items = rows * blocks;
  const int64_t shares = std::min(threads, items);
  // Shares of whole items in order, the first on this thread; the last to finish completes the future.
  ffi::CountDownPromise done(shares);
  auto run = [pb, blocks, items, shares, done](int64_t s) mutable {
    AttendRange(pb, blocks, items * s / shares, items * (s + 1) / shares);
    done.CountDown(1);
  };
  for (int64_t s = 1; s < shares; ++s) pool.Schedule([run, s]() mutable { run(s); });
  run(0);
  return ffi::Future(done);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshworkPagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q (B, L, H, K)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k pool (layers, N, T, G, K)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v pool
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page table (B, P)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // positions (B, L)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // (layer, window or 0)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sinks (H,) or (0,)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out (B, L, H, K)
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap"));
