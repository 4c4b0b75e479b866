// The register-tiled micro-kernel of the small products (mk_mm), shared by FlashAttention (attention.cpp) and the
// gated delta rule (gated_delta.cpp), where a BLAS call would cost more than the product.

#pragma once

#include "common.h"

namespace {

// The small products' micro-kernel (FlashAttention's blocks, the gated delta rule's chunks): C[MR, NV lanes] (+)=
// A B with the C tile in registers, in the machine's own vector width, so the tile fits the register file: with
// AVX-512, 8 x 32 tiles of 16-lane vectors (16 accumulators); otherwise (AVX2, NEON) 6 x 16 tiles of 8-lane ones
// (12 accumulators, 2 for B, 1 broadcast: 15 of 16 AVX2 registers). A tile of 16-lane vectors on an AVX2 machine
// needs 32 registers and spills, far below the GEMM rate (docs/benchmarks.md).
#if defined(__AVX512F__)
constexpr int kMkLanes = 16, kMkRows = 8;
#else
constexpr int kMkLanes = 8, kMkRows = 6;
#endif
typedef float mk_vec __attribute__((vector_size(kMkLanes * sizeof(float)), aligned(4)));

inline mk_vec mk_load(const float* p) { return *reinterpret_cast<const mk_vec*>(p); }
inline void mk_store(float* p, mk_vec v) { *reinterpret_cast<mk_vec*>(p) = v; }

template <int MR, int NV>
inline void mk_tile(int K, const float* a, size_t ai, size_t ak, const float* b, size_t ldb, float* c, size_t ldc,
                    bool acc) {
  mk_vec r[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) r[i][v] = acc ? mk_load(c + i * ldc + v * kMkLanes) : mk_vec{};
  for (int k = 0; k < K; ++k) {
    const float* bk = b + size_t(k) * ldb;
    mk_vec bv[NV];
    for (int v = 0; v < NV; ++v) bv[v] = mk_load(bk + v * kMkLanes);
    const float* ak_ = a + size_t(k) * ak;
    for (int i = 0; i < MR; ++i) {
      const float x = ak_[i * ai];
      for (int v = 0; v < NV; ++v) r[i][v] += x * bv[v];
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) mk_store(c + i * ldc + v * kMkLanes, r[i][v]);
}

// mk_tile for a tile of mr <= kMkRows rows and nv (1 or 2) vectors of columns.
template <int NV>
void mk_tile_n(int mr, int K, const float* a, size_t ai, size_t ak, const float* b, size_t ldb, float* c, size_t ldc,
               bool acc) {
  switch (mr) {
    case 8: if constexpr (kMkRows >= 8) mk_tile<8, NV>(K, a, ai, ak, b, ldb, c, ldc, acc); break;
    case 7: if constexpr (kMkRows >= 7) mk_tile<7, NV>(K, a, ai, ak, b, ldb, c, ldc, acc); break;
    case 6: mk_tile<6, NV>(K, a, ai, ak, b, ldb, c, ldc, acc); break;
    case 5: mk_tile<5, NV>(K, a, ai, ak, b, ldb, c, ldc, acc); break;
    case 4: mk_tile<4, NV>(K, a, ai, ak, b, ldb, c, ldc, acc); break;
    case 3: mk_tile<3, NV>(K, a, ai, ak, b, ldb, c, ldc, acc); break;
    case 2: mk_tile<2, NV>(K, a, ai, ak, b, ldb, c, ldc, acc); break;
    case 1: mk_tile<1, NV>(K, a, ai, ak, b, ldb, c, ldc, acc); break;
    default: break;
  }
}

// What a product may skip (its [c, c] operands are triangular): kLowerA, A(i, k) = 0 for k > i (the inverse,
// P = L * QK); kUpperA, A(i, k) = 0 for k < i (their transposes); kLowerC, only C(i, j) for j <= i is read
// afterwards (K K^T, Q K^T, dO U^T; what lies above is left as it was).
enum MkShape { kFull, kLowerA, kUpperA, kLowerC };

// C[M, N] (+)= A B: A(i, k) = a[i ai + k ak], B row-major [K, N] with row stride ldb, N a multiple of 16.
// Per block of 2 vectors' columns (B's block stays in L1), every tile of rows.
void mk_mm(int M, int N, int K, const float* a, size_t ai, size_t ak, const float* b, size_t ldb, float* c,
           size_t ldc, bool acc, MkShape shape = kFull) {
  for (int j = 0; j < N; j += 2 * kMkLanes) {
    const bool two = N - j >= 2 * kMkLanes;
    for (int i = 0; i < M; i += kMkRows) {
      const int mr = std::min(kMkRows, M - i);
      if (shape == kLowerC && j > i + mr - 1) continue;  // the tile lies above the diagonal
      const int k0 = shape == kUpperA ? std::min(K, i) : 0, k1 = shape == kLowerA ? std::min(K, i + mr) : K;
      const float* ap = a + i * ai + size_t(k0) * ak;
      const float* bp = b + size_t(k0) * ldb + j;
      float* cp = c + i * ldc + j;
      if (two) {
        mk_tile_n<2>(mr, std::max(0, k1 - k0), ap, ai, ak, bp, ldb, cp, ldc, acc);
      } else {
        mk_tile_n<1>(mr, std::max(0, k1 - k0), ap, ai, ak, bp, ldb, cp, ldc, acc);
      }
    }
  }
}

}  // namespace
