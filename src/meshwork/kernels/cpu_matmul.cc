// A few rows times a packed weight on the CPU: an XLA FFI custom call for decode's projections.
//
// At one to a few dozen rows a projection is a matrix-vector product that reads every weight once
// and does little else, so its speed is the memory's. XLA:CPU runs such a dot on one thread (about
// 21 GB/s on the 2-core host of benchmarks/RESULTS.md, which reads 45 GB/s with both cores). This
// kernel splits the output columns over XLA's intra-op threads and reads the weight in the layout
// cpu_matmul.py packs it into: (T, K, 64), column tile t holding columns 64t..64t+63 of the (K, N)
// weight row after row, so each thread streams whole tiles front to back.
//   y (M, T * 64) = x (M, K) @ W, W[k, 64t + j] = tiles[t, k, j].
// Each output is one fused multiply-add chain over k in order, whatever M and however the columns
// are split: a row's result does not depend on the other rows of the batch (batch invariance).
// While a tile is in cache every group of rows reads it, so the weight is read from memory once.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kTile = 64;  // columns per tile

// Accumulators live in registers. AVX-512 has 32 vector registers of 16 floats: 6 rows x 4 vectors
// as accumulators (a prefill chunk's products run near the FMA units' peak), or 4 tiles x 4 vectors
// for one row (more reads in flight). AVX2 has 16 of 8 floats: one row of one tile, 8 vectors.
#ifdef __AVX512F__
constexpr int kLanes = 16, kRowsAtOnce = 6, kTilesAtOnce = 4;
#else
constexpr int kLanes = 8, kRowsAtOnce = 1, kTilesAtOnce = 1;
#endif
constexpr int kVectors = kTile / kLanes;  // per tile row
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));

inline Vec Load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Rows [0, R) of x times tiles [t, t + NT): R x NT x kVectors accumulators over all of K.
template <int R, int NT>
void Tiles(const float* x, const float* tiles, float* y, int64_t K, int64_t N, int64_t t) {
  Vec acc[R][NT][kVectors] = {};
  const float* w = tiles + t * K * kTile;
  for (int64_t k = 0; k < K; ++k) {
    for (int n = 0; n < NT; ++n) {
      const float* wk = w + (n * K + k) * kTile;
      Vec wv[kVectors];
      for (int v = 0; v < kVectors; ++v) wv[v] = Load(wk + v * kLanes);
      for (int r = 0; r < R; ++r) {
        const float xs = x[r * K + k];
        for (int v = 0; v < kVectors; ++v) acc[r][n][v] += xs * wv[v];
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NT; ++n)
      for (int v = 0; v < kVectors; ++v)
        std::memcpy(y + r * N + (t + n) * kTile + v * kLanes, &acc[r][n][v], sizeof(Vec));
}

// Tiles [t0, t1) for all M rows. One row reads several tiles at a time (more reads in flight); more
// rows read one tile per pass over the row groups, each group's accumulators in registers.
void Columns(const float* x, const float* tiles, float* y, int64_t M, int64_t K, int64_t N, int64_t t0,
             int64_t t1) {
  int64_t t = t0;
  if (M == 1 && kTilesAtOnce > 1)
    for (; t + kTilesAtOnce <= t1; t += kTilesAtOnce) Tiles<1, kTilesAtOnce>(x, tiles, y, K, N, t);
  for (; t < t1; ++t) {
    int64_t m = 0;
    for (; m + kRowsAtOnce <= M; m += kRowsAtOnce) Tiles<kRowsAtOnce, 1>(x + m * K, tiles, y + m * N, K, N, t);
    if constexpr (kRowsAtOnce > 4)
      for (; m + 4 <= M; m += 4) Tiles<4, 1>(x + m * K, tiles, y + m * N, K, N, t);
    if constexpr (kRowsAtOnce > 2)
      for (; m + 2 <= M; m += 2) Tiles<2, 1>(x + m * K, tiles, y + m * N, K, N, t);
    if constexpr (kRowsAtOnce > 1)
      for (; m < M; ++m) Tiles<1, 1>(x + m * K, tiles, y + m * N, K, N, t);
  }
}

ffi::Future PackedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> tiles,
                             ffi::ResultBuffer<ffi::F32> y) {
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1], T = tiles.dimensions()[0];
  const float* xp = x.typed_data();
  const float* wp = tiles.typed_data();
  float* yp = y->typed_data();
  // Workers (this thread and up to num_threads - 1 of the pool) take chunks of kTilesAtOnce tiles
  // from a shared counter until none is left: on a shared machine a thread that another process
  // delays computes fewer chunks instead of holding up the call with a fixed half. The last worker
  // to finish completes the future.
  const int64_t chunks = (T + kTilesAtOnce - 1) / kTilesAtOnce;
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), chunks));
  auto next = std::make_shared<std::atomic<int64_t>>(0);
  ffi::CountDownPromise done(workers);
  auto run = [=]() mutable {
    for (int64_t c; (c = next->fetch_add(1, std::memory_order_relaxed)) < chunks;)
      Columns(xp, wp, yp, M, K, T * kTile, c * kTilesAtOnce, std::min(T, (c + 1) * kTilesAtOnce));
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
