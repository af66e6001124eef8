// Rows times a packed weight on the CPU: an XLA FFI custom call for a served model's projections.
//
// At one to a few dozen rows a projection is a matrix-vector product that reads every weight once
// and does little else, so its speed is the memory's. XLA:CPU runs such a dot on one thread (about
// 21 GB/s on the 2-core host of benchmarks/RESULTS.md, which reads 33-45 GB/s with both cores). This
// kernel splits the output columns over XLA's intra-op threads and reads the weight in the layout
// cpu_matmul.py packs it into: (T, K, 64), column tile t holding columns 64t..64t+63 of the (K, N)
// weight row after row, so each tile is one contiguous run.
//   y (M, T * 64) = x (M, K) @ W, W[k, 64t + j] = tiles[t, k, j].
// Each output is one fused multiply-add chain over k in order, whatever M and however the tiles are
// shared out: a row's result does not depend on the other rows of the batch (batch invariance).
// While a tile is in cache every group of rows reads it, so a prefill chunk of hundreds of rows
// also reads the weight from memory once, and its products run near the FMA units' peak.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kTile = 64;  // columns per tile

// Accumulators live in registers. AVX-512 has 32 vector registers of 16 floats: 6 rows x 4 vectors
// as accumulators, so a prefill chunk's products run near the FMA units' peak. AVX2 has 16 of 8
// floats: one row, 8 vectors.
#ifdef __AVX512F__
constexpr int kLanes = 16, kRowsAtOnce = 6;
#else
constexpr int kLanes = 8, kRowsAtOnce = 1;
#endif
constexpr int kVectors = kTile / kLanes;  // per tile row

// Below this many rows a call is bound by the weight's read, and the hardware prefetcher alone
// restarts at every tile (128 KB at K = 512): the first pass over a tile asks for the rows
// kPrefetchAhead ahead (8 KB), which took 4-18% off benchmarks/RESULTS.md's 8-layer product chain at
// one row. With more rows the FMA units are the limit and the extra instructions only cost.
constexpr int kPrefetchBelowRows = 6, kPrefetchAhead = 32;
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));

inline Vec Load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Rows [0, R) of x times tile t: R x kVectors accumulators over all of K.
template <int R, bool kPrefetch>
void Tile(const float* x, const float* tiles, float* y, int64_t K, int64_t N, int64_t t) {
  Vec acc[R][kVectors] = {};
  const float* w = tiles + t * K * kTile;
  for (int64_t k = 0; k < K; ++k) {
    Vec wv[kVectors];
    for (int v = 0; v < kVectors; ++v) wv[v] = Load(w + k * kTile + v * kLanes);
    if constexpr (kPrefetch)  // a hint: past the buffer's end it reads nothing and cannot fault
      for (int line = 0; line < kTile; line += 64 / sizeof(float))
        __builtin_prefetch(w + (k + kPrefetchAhead) * kTile + line, 0, 0);
    for (int r = 0; r < R; ++r) {
      const float xs = x[r * K + k];
      for (int v = 0; v < kVectors; ++v) acc[r][v] += xs * wv[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVectors; ++v) std::memcpy(y + r * N + t * kTile + v * kLanes, &acc[r][v], sizeof(Vec));
}

// Tile t for all M rows, group by group of rows while the tile is in cache: each weight is read
// from memory once per call, by the first group (which prefetches it when M is small).
void Column(const float* x, const float* tiles, float* y, int64_t M, int64_t K, int64_t N, int64_t t) {
  int64_t m = 0;
  auto group = [&](auto rows) {
    constexpr int R = decltype(rows)::value;
    if (m == 0 && M < kPrefetchBelowRows)
      Tile<R, true>(x + m * K, tiles, y + m * N, K, N, t);
    else
      Tile<R, false>(x + m * K, tiles, y + m * N, K, N, t);
    m += R;
  };
  using std::integral_constant;
  while (m + kRowsAtOnce <= M) group(integral_constant<int, kRowsAtOnce>());
  if constexpr (kRowsAtOnce > 4)
    while (m + 4 <= M) group(integral_constant<int, 4>());
  if constexpr (kRowsAtOnce > 2)
    while (m + 2 <= M) group(integral_constant<int, 2>());
  if constexpr (kRowsAtOnce > 1)
    while (m < M) group(integral_constant<int, 1>());
}

ffi::Future PackedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> tiles,
                             ffi::ResultBuffer<ffi::F32> y) {
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1], T = tiles.dimensions()[0];
  const float* xp = x.typed_data();
  const float* wp = tiles.typed_data();
  float* yp = y->typed_data();
  // Workers (this thread and up to num_threads - 1 of the pool) take tiles from a shared counter
  // until none is left: on a shared machine a thread that another process delays computes fewer
  // tiles instead of holding up the call with a fixed half. The last worker to finish completes
  // the future.
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), T));
  auto next = std::make_shared<std::atomic<int64_t>>(0);
  ffi::CountDownPromise done(workers);
  auto run = [=]() mutable {
    for (int64_t t; (t = next->fetch_add(1, std::memory_order_relaxed)) < T;) Column(xp, wp, yp, M, K, T * kTile, t);
    done.CountDown(1);
  };
  for (int64_t w = 1; w < workers; ++w) pool.Schedule([run]() mutable { run(); });
  run();
  return ffi::Future(done);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshworkPackedMatmul, PackedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x (M, K)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // tiles (T, K, 64)
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y (M, T * 64)
