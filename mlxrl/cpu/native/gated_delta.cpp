// The gated delta rule (Gated DeltaNet, Qwen3.5's linear attention): forward and backward over the whole
// sequence, float32, as two MLX primitives. Not a translation unit of its own: bindings.cpp #includes it (it uses
// common.h's round_up, parallel_items, Scratch, fast_exp and primitive helpers and microkernel.h's mk_mm), and
// mlxrl.cpu.native's build compiles bindings.cpp alone. The math is the chunked
// WY form of `mlxrl.models.gated_delta` (its module docstring), chunk by chunk, the same formulas:
//
//   per chunk of c tokens from the chunk-start state S [dk, dv]: D_ij = sum_{j < m <= i} g_m (each entry a sum
//   of its own log decays), L_ij = exp(D_ij) (j <= i, same document), b_i = exp(sum_{m <= i} g_m) (0 after a
//   document start), last_j = exp(D_cj) (0 before the last document's start);
//   A_ij = beta_i L_ij k_i.k_j (j < i),  T = (I + A)^-1 (forward substitution, c^3 / 6 multiply-adds),
//   U = U0 - W S = T diag(beta) (V - diag(b) K S)     ([U0 | W] = T [diag(beta) V | diag(beta b) K]),
//   O = diag(b) Q S + (L * Q K^T) U,  S_end = b_c S + (diag(last) K)^T U.
//
// The forward (one item per batch row and value head, the chunks in order) writes the output, the final state
// and the state at each chunk's start ([N, B, Hv, dk, dv]: all the backward keeps besides the inputs). The
// backward (one item per batch row and KEY head: the value heads that read one key head add into its dq / dk
// rows, so each item owns the rows it writes) walks each value head's chunks in reverse, recomputes the chunk
// from its saved start state, turns dO and the state cotangent from the chunk after into the chunk's input
// gradients and passes dS back; then the q / k L2 normalisation's backward runs over the item's rows. Every
// intermediate is one chunk's, in a per-worker workspace (~1 MB at chunk 64, dk = dv = 128); the products
// ([c, c], [c, dk], [dk, dv] sized) run in a register-tiled micro-kernel (mk_mm) with every width padded to
// a multiple of 16 (zeros), skipping the zero triangles of the [c, c] factors: a BLAS call's packing and
// threading cost about as much as the work at these sizes, and the workers call it concurrently.

#include "common.h"
#include "microkernel.h"

namespace {

constexpr float kGdL2Eps = 1e-6f;  // transformers' (and flash-linear-attention's) l2norm eps

inline int pad16(int n) { return int(round_up(size_t(std::max(n, 0)), 16)); }

struct GdConfig {
  int chunk;
  float scale;
  bool l2norm;
  bool operator==(const GdConfig& o) const { return chunk == o.chunk && scale == o.scale && l2norm == o.l2norm; }
};

// q, k [B, T, Hk, dk]; v [B, T, Hv, dv]; g, beta [B, T, Hv]; chunks of C tokens; widths padded to 16.
struct GdDims {
  int B, T, Hk, Hv, dk, dv, C, N, groups;
  int Dk, Dv, Cp;  // padded dk, dv, chunk
  GdDims(const mx::array& q, const mx::array& v, int chunk)
      : B(q.shape(0)), T(q.shape(1)), Hk(q.shape(2)), Hv(v.shape(2)), dk(q.shape(3)), dv(v.shape(3)), C(chunk) {
    N = (T + C - 1) / C;
    groups = Hk > 0 ? Hv / Hk : 1;
    Dk = pad16(dk), Dv = pad16(dv), Cp = pad16(C);
  }
  size_t qrow(int b, int t, int hk) const { return ((size_t(b) * T + t) * Hk + hk) * dk; }
  size_t vrow(int b, int t, int hv) const { return ((size_t(b) * T + t) * Hv + hv) * dv; }
  size_t tok(int b, int t, int hv) const { return (size_t(b) * T + t) * Hv + hv; }
  size_t state(int n, int b, int hv) const { return ((size_t(n) * B + b) * Hv + hv) * dk * dv; }
};

inline float gd_dot(const float* a, const float* b, int n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// One worker's buffers: one chunk's everything, widths padded (rows Dk or Dv wide, [c, c] ones Cp wide).
struct GdWork {
  // both passes
  float *Q, *K, *Kt, *V, *beta, *gz, *gam, *D, *b, *last, *L, *KK, *QK, *T, *KS, *U, *S, *P, *Kl;
  int* seg;
  // forward: O; backward: the rest
  float *O, *Qb, *Kb, *dO, *dU, *dX1, *dX2, *dS, *dSn, *tmpS, *St, *dSt, *Ut, *dP, *Z, *M, *dQK, *dKl, *dQb, *dK,
      *dQ, *H, *dgb, *db, *dlast;

  GdWork(Scratch& scratch, const GdDims& d, bool backward) {
    const size_t C = d.C, Cp = d.Cp, Dk = d.Dk, Dv = d.Dv;
    std::vector<std::pair<float**, size_t>> slots;  // (buffer, offset) in one allocation, each 16-float aligned
    size_t n = 0;
    auto add = [&](std::initializer_list<float**> ps, size_t len) {
      for (float** p : ps) slots.emplace_back(p, n), n += round_up(len, 16);
    };
    float* segf;
    add({&Q, &K, &Kl}, C * Dk), add({&Kt}, Dk * Cp), add({&V, &KS, &U}, C * Dv), add({&S}, Dk * Dv);
    add({&beta, &gz, &gam, &D, &b, &last, &segf}, Cp), add({&L, &KK, &QK, &T, &P}, C * Cp);
    if (backward) {
      add({&Qb, &Kb, &dX2, &dKl, &dQb, &dK, &dQ}, C * Dk), add({&dO, &dU, &dX1}, C * Dv);
      add({&dS, &dSn, &tmpS}, Dk * Dv), add({&St, &dSt}, Dv * Dk), add({&Ut}, Dv * Cp);
      add({&dP, &Z, &M, &dQK}, C * Cp), add({&H, &dgb, &db, &dlast}, Cp);
    } else {
      add({&O}, C * Dv);
    }
    float* base = scratch.take(n);
    std::fill(base, base + n, 0.0f);  // the padding stays zero: only the real rows / columns are written
    for (auto& [p, off] : slots) *p = base + off;
    seg = reinterpret_cast<int*>(segf);
  }
};

struct GdInputs {
  const float *q, *k, *v, *g, *beta;
  const bool* starts;  // [B, T]
};

// A state [dk, dv] to the padded [Dk, Dv] buffer and back.
inline void gd_state_in(const GdDims& d, const float* src, float* S) {
  for (int i = 0; i < d.dk; ++i) std::copy(src + size_t(i) * d.dv, src + size_t(i + 1) * d.dv, S + size_t(i) * d.Dv);
}
inline void gd_state_out(const GdDims& d, const float* S, float* dst) {
  for (int i = 0; i < d.dk; ++i) std::copy(S + size_t(i) * d.Dv, S + size_t(i) * d.Dv + d.dv, dst + size_t(i) * d.dv);
}

// Chunk [s, s + c) of batch row b, value head hv, from the chunk-start state in w.S: loads Q (normalised,
// scaled), K (normalised), K^T, V, beta; the decays; KK = K K^T and QK = Q K^T (lower triangles),
// T = (I + A)^-1, U = T diag(beta) (V - diag(b) K S) (= U0 - W S: W itself is never formed), P = L * QK and
// Kl = diag(last) K.
void gd_prepare(const GdDims& d, const GdConfig& cfg, const GdInputs& in, GdWork& w, int b, int hv, int s, int c) {
  const int hk = hv / d.groups, cp = pad16(c), Dk = d.Dk, Dv = d.Dv, Cp = d.Cp;
  for (int i = 0; i < c; ++i) {
    const float *qr = in.q + d.qrow(b, s + i, hk), *kr = in.k + d.qrow(b, s + i, hk);
    float qs = cfg.scale, ks = 1.0f;
    if (cfg.l2norm) {
      qs /= std::sqrt(gd_dot(qr, qr, d.dk) + kGdL2Eps);
      ks /= std::sqrt(gd_dot(kr, kr, d.dk) + kGdL2Eps);
    }
    float *Qi = w.Q + size_t(i) * Dk, *Ki = w.K + size_t(i) * Dk;
#pragma omp simd
    for (int e = 0; e < d.dk; ++e) Qi[e] = qr[e] * qs, Ki[e] = kr[e] * ks;
    for (int e = 0; e < d.dk; ++e) w.Kt[size_t(e) * Cp + i] = Ki[e];
    const float* vr = in.v + d.vrow(b, s + i, hv);
    std::copy(vr, vr + d.dv, w.V + size_t(i) * Dv);
    w.beta[i] = in.beta[d.tok(b, s + i, hv)];
  }
  for (int e = 0; e < d.dk; ++e) std::fill(w.Kt + size_t(e) * Cp + c, w.Kt + size_t(e) * Cp + cp, 0.0f);

  // decays: a start's own decay multiplies a dropped state (0). Every log decay is a sum of its own g's, never a
  // difference of cumulative sums: D holds row i of D_ij = sum_{j < m <= i} g_m, the row before plus g_i
  const bool* st = in.starts + size_t(b) * d.T + s;
  int seg = 0;
  for (int i = 0; i < c; ++i) {
    if (st[i]) ++seg;
    w.seg[i] = seg;
    w.gz[i] = st[i] ? 0.0f : in.g[d.tok(b, s + i, hv)];
    w.gam[i] = (i > 0 ? w.gam[i - 1] : 0.0f) + w.gz[i];  // read in the first segment only (b)
  }
  const int sl = w.seg[c - 1];
  for (int i = 0; i < c; ++i) {
    w.b[i] = w.seg[i] == 0 ? fast_exp(w.gam[i]) : 0.0f;
    const float gi = w.gz[i];
#pragma omp simd
    for (int j = 0; j < i; ++j) w.D[j] += gi;
    w.D[i] = 0.0f;
    float* Li = w.L + size_t(i) * Cp;
    for (int j = 0; j <= i; ++j) Li[j] = w.seg[j] == w.seg[i] ? fast_exp(w.D[j]) : 0.0f;
    std::fill(Li + i + 1, Li + cp, 0.0f);
  }
  for (int j = 0; j < c; ++j) w.last[j] = w.seg[j] == sl ? fast_exp(w.D[j]) : 0.0f;  // D's last row

  mk_mm(c, cp, d.dk, w.K, Dk, 1, w.Kt, Cp, w.KK, Cp, false, kLowerC);
  mk_mm(c, cp, d.dk, w.Q, Dk, 1, w.Kt, Cp, w.QK, Cp, false, kLowerC);
  // T = (I + A)^-1 by forward substitution: row i = e_i - sum_{m < i} A_im (row m), row m zero past m
  for (int i = 0; i < c; ++i) {
    float* Ti = w.T + size_t(i) * Cp;
    std::fill(Ti, Ti + cp, 0.0f);
    const float *Li = w.L + size_t(i) * Cp, *KKi = w.KK + size_t(i) * Cp;
    for (int m = 0; m < i; ++m) {
      const float a = w.beta[i] * Li[m] * KKi[m];
      if (a == 0.0f) continue;
      const float* Tm = w.T + size_t(m) * Cp;
#pragma omp simd
      for (int j = 0; j <= m; ++j) Ti[j] -= a * Tm[j];
    }
    Ti[i] = 1.0f;
  }
  mk_mm(c, Dv, d.dk, w.K, Dk, 1, w.S, Dv, w.KS, Dv, false);  // K S
  for (int i = 0; i < c; ++i) {  // -> diag(beta) (V - diag(b) K S), in place
    float* r = w.KS + size_t(i) * Dv;
    const float* Vi = w.V + size_t(i) * Dv;
    const float bt = w.beta[i], bi = w.b[i];
#pragma omp simd
    for (int e = 0; e < Dv; ++e) r[e] = bt * (Vi[e] - bi * r[e]);
  }
  mk_mm(c, Dv, c, w.T, Cp, 1, w.KS, Dv, w.U, Dv, false, kLowerA);
  for (int i = 0; i < c; ++i) {
    float *Pi = w.P + size_t(i) * Cp, *Kli = w.Kl + size_t(i) * Dk;
    const float *Li = w.L + size_t(i) * Cp, *QKi = w.QK + size_t(i) * Cp, *Ki = w.K + size_t(i) * Dk;
#pragma omp simd
    for (int j = 0; j < cp; ++j) Pi[j] = j <= i ? Li[j] * QKi[j] : 0.0f;  // QK's upper triangle is stale
    const float l = w.last[i];
#pragma omp simd
    for (int e = 0; e < Dk; ++e) Kli[e] = l * Ki[e];
  }
}

// The chunk's output rows (into out) and the state at its end (w.S in place).
void gd_forward_chunk(const GdDims& d, GdWork& w, float* out, int b, int hv, int s, int c) {
  const int Dk = d.Dk, Dv = d.Dv, Cp = d.Cp;
  mk_mm(c, Dv, d.dk, w.Q, Dk, 1, w.S, Dv, w.O, Dv, false);  // Q S
  for (int i = 0; i < c; ++i) {
    float* Oi = w.O + size_t(i) * Dv;
    const float bi = w.b[i];
#pragma omp simd
    for (int e = 0; e < Dv; ++e) Oi[e] *= bi;
  }
  mk_mm(c, Dv, c, w.P, Cp, 1, w.U, Dv, w.O, Dv, true, kLowerA);  // + P U
  for (int i = 0; i < c; ++i) {
    const float* Oi = w.O + size_t(i) * Dv;
    std::copy(Oi, Oi + d.dv, out + d.vrow(b, s + i, hv));
  }
  const float be = w.b[c - 1];
  for (size_t i = 0; i < size_t(d.dk) * Dv; ++i) w.S[i] *= be;
  mk_mm(d.dk, Dv, c, w.Kl, 1, Dk, w.U, Dv, w.S, Dv, true);  // + (diag(last) K)^T U
}

struct GdGrads {
  float *dq, *dk, *dv, *dg, *dbeta;
};

// The chunk's gradients from dO (d_out's rows) and the state cotangent at its end (w.dS, replaced by the one
// at its start); dq / dk add into the key head's rows (dq scaled, before the L2 backward). With X1 = diag(beta) V
// and X2 = diag(beta b) K (U0 = T X1, W = T X2, U = U0 - W S): dX1 = T^T dU, and since T^T (dU S^T) = dX1 S^T,
// dX2 = -dX1 S^T and dA = -(dX1 U0^T + dX2 W^T) = -dX1 U^T (strictly lower); W^T dU = X2^T dX1.
void gd_backward_chunk(const GdDims& d, const GdConfig& cfg, const GdInputs& in, GdWork& w, const float* d_out,
                       const GdGrads& gr, int b, int hv, int s, int c) {
  const int hk = hv / d.groups, cp = pad16(c), Dk = d.Dk, Dv = d.Dv, Cp = d.Cp, dk = d.dk, dv = d.dv;
  for (int i = 0; i < c; ++i) {
    const float* src = d_out + d.vrow(b, s + i, hv);
    std::copy(src, src + dv, w.dO + size_t(i) * Dv);
    float *Qbi = w.Qb + size_t(i) * Dk, *Kbi = w.Kb + size_t(i) * Dk;
    const float *Qi = w.Q + size_t(i) * Dk, *Ki = w.K + size_t(i) * Dk;
    const float bi = w.b[i], bb = w.beta[i] * w.b[i];
#pragma omp simd
    for (int e = 0; e < Dk; ++e) Qbi[e] = bi * Qi[e], Kbi[e] = bb * Ki[e];
  }
  // transposes: S^T, dS^T [dv, dk]; U^T [dv, c]
  for (int e = 0; e < dk; ++e)
    for (int f = 0; f < dv; ++f) {
      w.St[size_t(f) * Dk + e] = w.S[size_t(e) * Dv + f];
      w.dSt[size_t(f) * Dk + e] = w.dS[size_t(e) * Dv + f];
    }
  for (int f = 0; f < dv; ++f) {
    float* Uf = w.Ut + size_t(f) * Cp;
    for (int i = 0; i < c; ++i) Uf[i] = w.U[size_t(i) * Dv + f];
    std::fill(Uf + c, Uf + cp, 0.0f);
  }

  mk_mm(c, Dv, c, w.P, 1, Cp, w.dO, Dv, w.dU, Dv, false, kUpperA);  // dU = P^T dO
  mk_mm(c, Dv, dk, w.Kl, Dk, 1, w.dS, Dv, w.dU, Dv, true);           //    + Kl dS_end
  mk_mm(c, cp, dv, w.dO, Dv, 1, w.Ut, Cp, w.dP, Cp, false, kLowerC);  // dP = dO U^T
  mk_mm(c, Dk, dv, w.U, Dv, 1, w.dSt, Dk, w.dKl, Dk, false);          // dKl = U dS_end^T
  mk_mm(c, Dk, dv, w.dO, Dv, 1, w.St, Dk, w.dQb, Dk, false);          // dQb = dO S^T
  const float db_end = gd_dot(w.S, w.dS, dk * Dv);
  mk_mm(c, Dv, c, w.T, 1, Cp, w.dU, Dv, w.dX1, Dv, false, kUpperA);  // dX1 = T^T dU
  mk_mm(c, Dk, dv, w.dX1, Dv, 1, w.St, Dk, w.dX2, Dk, false);        // -dX2 = dX1 S^T
  for (int i = 0; i < c; ++i) {
    float* r = w.dX2 + size_t(i) * Dk;
#pragma omp simd
    for (int e = 0; e < Dk; ++e) r[e] = -r[e];
  }
  mk_mm(c, cp, dv, w.dX1, Dv, 1, w.Ut, Cp, w.Z, Cp, false, kLowerC);  // Z = dX1 U^T = -dA
  // dS_start = Qb^T dO + b_end dS_end - X2^T dX1
  mk_mm(dk, Dv, c, w.Qb, 1, Dk, w.dO, Dv, w.dSn, Dv, false);
  mk_mm(dk, Dv, c, w.Kb, 1, Dk, w.dX1, Dv, w.tmpS, Dv, false);
  const float be = w.b[c - 1];
  for (size_t i = 0; i < size_t(dk) * Dv; ++i) w.dSn[i] += be * w.dS[i] - w.tmpS[i];
  std::swap(w.dS, w.dSn);

  // A = beta_i L_ij KK_ij;  P = L QK;  X1 = beta V;  X2 = beta b K;  Qb = b Q;  Kl = last K
  std::fill(w.H, w.H + c, 0.0f);
  for (int i = 0; i < c; ++i) std::fill(w.M + size_t(i) * Cp, w.M + size_t(i) * Cp + cp, 0.0f);
  for (int i = 0; i < c; ++i) {
    const float *Li = w.L + size_t(i) * Cp, *KKi = w.KK + size_t(i) * Cp, *QKi = w.QK + size_t(i) * Cp;
    const float *Zi = w.Z + size_t(i) * Cp, *dPi = w.dP + size_t(i) * Cp;
    const float *dX1 = w.dX1 + size_t(i) * Dv, *dX2 = w.dX2 + size_t(i) * Dk, *Ki = w.K + size_t(i) * Dk;
    float* dQKi = w.dQK + size_t(i) * Cp;
    const float bt = w.beta[i];
    float sb = 0.0f, run = 0.0f;
    for (int j = 0; j < i; ++j) {
      const float dA = -Zi[j], dAL = dA * Li[j];
      sb += dAL * KKi[j];
      w.M[size_t(i) * Cp + j] += bt * dAL;  // dKK + dKK^T
      w.M[size_t(j) * Cp + i] += bt * dAL;
      run += (bt * dA * KKi[j] + dPi[j] * QKi[j]) * Li[j];  // row i's G_ij, j < m, for m = j + 1 <= i
      w.H[j + 1] += run;
    }
#pragma omp simd
    for (int j = 0; j < cp; ++j) dQKi[j] = j <= i ? dPi[j] * Li[j] : 0.0f;  // dP's upper triangle is stale
    const float x2k = gd_dot(dX2, Ki, dk);
    w.dlast[i] = gd_dot(w.dKl + size_t(i) * Dk, Ki, dk) * w.last[i];
    w.db[i] = bt * x2k + gd_dot(w.dQb + size_t(i) * Dk, w.Q + size_t(i) * Dk, dk) + (i == c - 1 ? db_end : 0.0f);
    gr.dbeta[d.tok(b, s + i, hv)] = sb + gd_dot(dX1, w.V + size_t(i) * Dv, dv) + w.b[i] * x2k;
    float* dvr = gr.dv + d.vrow(b, s + i, hv);
#pragma omp simd
    for (int e = 0; e < dv; ++e) dvr[e] = bt * dX1[e];
  }
  // dg_m = H_m + sum_{i >= m} db_i b_i + sum_{j < m} dlast_j (H_m = sum_{i >= m, j < m} G_ij): each sum runs
  // over terms that carry g_m's decay only, so nothing cancels; across a start L, b and last are 0
  float suffix = 0.0f, prefix = 0.0f;
  for (int i = c - 1; i >= 0; --i) {
    suffix += w.db[i] * w.b[i];
    w.dgb[i] = suffix;
  }
  const bool* st = in.starts + size_t(b) * d.T + s;
  for (int m = 0; m < c; ++m) {
    gr.dg[d.tok(b, s + m, hv)] = st[m] ? 0.0f : w.H[m] + w.dgb[m] + prefix;
    prefix += w.dlast[m];
  }

  // dK = (dKK + dKK^T) K + dQK^T Q + beta b dX2 + last dKl;  dQ = dQK K + b dQb
  mk_mm(c, Dk, c, w.M, Cp, 1, w.K, Dk, w.dK, Dk, false);
  mk_mm(c, Dk, c, w.dQK, 1, Cp, w.Q, Dk, w.dK, Dk, true, kUpperA);
  mk_mm(c, Dk, c, w.dQK, Cp, 1, w.K, Dk, w.dQ, Dk, false, kLowerA);
  for (int i = 0; i < c; ++i) {
    const float *dKi = w.dK + size_t(i) * Dk, *dQi = w.dQ + size_t(i) * Dk, *dX2 = w.dX2 + size_t(i) * Dk;
    const float *dKli = w.dKl + size_t(i) * Dk, *dQbi = w.dQb + size_t(i) * Dk;
    const float bb = w.beta[i] * w.b[i], l = w.last[i], bi = w.b[i], sc = cfg.scale;
    float *dqr = gr.dq + d.qrow(b, s + i, hk), *dkr = gr.dk + d.qrow(b, s + i, hk);
#pragma omp simd
    for (int e = 0; e < dk; ++e) {
      dkr[e] += dKi[e] + bb * dX2[e] + l * dKli[e];
      dqr[e] += sc * (dQi[e] + bi * dQbi[e]);
    }
  }
}

// dx = (dy - y (y . dy)) / sqrt(|x|^2 + eps) with y = x / sqrt(|x|^2 + eps), over the rows of one key head, in place.
void gd_l2_backward(const GdDims& d, const float* x, float* dx, int b, int hk) {
  for (int t = 0; t < d.T; ++t) {
    const float* xr = x + d.qrow(b, t, hk);
    float* g = dx + d.qrow(b, t, hk);
    const float r = 1.0f / std::sqrt(gd_dot(xr, xr, d.dk) + kGdL2Eps);
    const float yg = gd_dot(xr, g, d.dk) * r;
#pragma omp simd
    for (int e = 0; e < d.dk; ++e) g[e] = (g[e] - xr[e] * r * yg) * r;
  }
}

std::vector<mx::array> gated_delta_grad_op(const std::vector<mx::array>& inputs, const GdConfig& cfg, mx::Stream s);

class GdPrimitive : public CpuPrimitive {
 public:
  GdPrimitive(mx::Stream s, GdConfig cfg) : CpuPrimitive(s), cfg_(cfg) {}
  bool is_equivalent(const mx::Primitive& other) const override {
    return CpuPrimitive::is_equivalent(other) && static_cast<const GdPrimitive&>(other).cfg_ == cfg_;
  }

 protected:
  GdConfig cfg_;
};

// inputs q, k, v, g, beta, state, starts (bool); outputs out [B, T, Hv, dv], final [B, Hv, dk, dv], the
// chunk-start states [N, B, Hv, dk, dv].
class GatedDelta : public GdPrimitive {
 public:
  using GdPrimitive::GdPrimitive;
  const char* name() const override { return "MlxrlGatedDelta"; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    const GdDims d(inputs[0], inputs[2], cfg_.chunk);
    return {inputs[2].shape(), inputs[5].shape(), mx::Shape{d.N, d.B, d.Hv, d.dk, d.dv}};
  }
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    encode_outputs(stream(), inputs, outputs).dispatch([d = GdDims(inputs[0], inputs[2], cfg_.chunk), cfg = cfg_,
        in = GdInputs{inputs[0].data<float>(), inputs[1].data<float>(), inputs[2].data<float>(),
                      inputs[3].data<float>(), inputs[4].data<float>(), inputs[6].data<bool>()},
        s0 = inputs[5].data<float>(), out = outputs[0].data<float>(), fin = outputs[1].data<float>(),
        saved = outputs[2].data<float>()]() {
      const size_t items = size_t(d.B) * d.Hv, workers = std::min<size_t>(worker_count(), items);
      if (items == 0) return;
      Scratch scratch;
      std::vector<GdWork> work;
      for (size_t w = 0; w < workers; ++w) work.emplace_back(scratch, d, false);
      parallel_items(items, workers, [&](size_t wi, size_t item) {
        GdWork& w = work[wi];
        const int b = int(item / d.Hv), hv = int(item % d.Hv);
        gd_state_in(d, s0 + d.state(0, b, hv), w.S);
        for (int n = 0; n < d.N; ++n) {
          const int s = n * d.C, c = std::min(d.C, d.T - s);
          gd_state_out(d, w.S, saved + d.state(n, b, hv));
          gd_prepare(d, cfg, in, w, b, hv, s, c);
          gd_forward_chunk(d, w, out, b, hv, s, c);
        }
        gd_state_out(d, w.S, fin + d.state(0, b, hv));
      });
    });
  }
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>& outputs) override {
    auto s = stream();
    auto grads = gated_delta_grad_op({primals[0], primals[1], primals[2], primals[3], primals[4], primals[6],
                                      outputs[2], dense_cotangent(cotangents[0], outputs[0], s),
                                      dense_cotangent(cotangents[1], outputs[1], s)}, cfg_, s);
    std::vector<mx::array> out;
    for (int a : argnums) out.push_back(a < 6 ? grads[a] : mx::zeros_like(primals[a], s));
    return out;
  }
};

// inputs q, k, v, g, beta, starts, the chunk-start states, d_out, d_final; outputs dq, dk, dv, dg, dbeta,
// d_state (the initial state's).
class GatedDeltaGrad : public GdPrimitive {
 public:
  using GdPrimitive::GdPrimitive;
  const char* name() const override { return "MlxrlGatedDeltaGrad"; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape(), inputs[1].shape(), inputs[2].shape(), inputs[3].shape(), inputs[4].shape(),
            inputs[8].shape()};
  }
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    encode_outputs(stream(), inputs, outputs).dispatch([d = GdDims(inputs[0], inputs[2], cfg_.chunk), cfg = cfg_,
        in = GdInputs{inputs[0].data<float>(), inputs[1].data<float>(), inputs[2].data<float>(),
                      inputs[3].data<float>(), inputs[4].data<float>(), inputs[5].data<bool>()},
        saved = inputs[6].data<float>(), d_out = inputs[7].data<float>(), d_fin = inputs[8].data<float>(),
        gr = GdGrads{outputs[0].data<float>(), outputs[1].data<float>(), outputs[2].data<float>(),
                     outputs[3].data<float>(), outputs[4].data<float>()},
        d_state = outputs[5].data<float>()]() {
      const size_t items = size_t(d.B) * d.Hk, workers = std::min<size_t>(worker_count(), items);
      if (items == 0) return;
      Scratch scratch;
      std::vector<GdWork> work;
      for (size_t w = 0; w < workers; ++w) work.emplace_back(scratch, d, true);
      parallel_items(items, workers, [&](size_t wi, size_t item) {
        GdWork& w = work[wi];
        const int b = int(item / d.Hk), hk = int(item % d.Hk);
        for (int t = 0; t < d.T; ++t) {  // the key head's rows: every value head of its group adds into them
          std::fill(gr.dq + d.qrow(b, t, hk), gr.dq + d.qrow(b, t, hk) + d.dk, 0.0f);
          std::fill(gr.dk + d.qrow(b, t, hk), gr.dk + d.qrow(b, t, hk) + d.dk, 0.0f);
        }
        for (int hv = hk * d.groups; hv < (hk + 1) * d.groups; ++hv) {
          std::fill(w.dS, w.dS + size_t(d.Dk) * d.Dv, 0.0f);
          gd_state_in(d, d_fin + d.state(0, b, hv), w.dS);
          for (int n = d.N - 1; n >= 0; --n) {
            const int s = n * d.C, c = std::min(d.C, d.T - s);
            gd_state_in(d, saved + d.state(n, b, hv), w.S);
            gd_prepare(d, cfg, in, w, b, hv, s, c);
            gd_backward_chunk(d, cfg, in, w, d_out, gr, b, hv, s, c);
          }
          gd_state_out(d, w.dS, d_state + d.state(0, b, hv));
        }
        if (cfg.l2norm) {
          gd_l2_backward(d, in.q, gr.dq, b, hk);
          gd_l2_backward(d, in.k, gr.dk, b, hk);
        }
      });
    });
  }
};

std::vector<mx::array> gated_delta_grad_op(const std::vector<mx::array>& inputs, const GdConfig& cfg, mx::Stream s) {
  std::vector<mx::array> in;
  for (auto& a : inputs) in.push_back(dense(a, s));
  const auto& q = inputs[0];
  return mx::array::make_arrays({q.shape(), inputs[1].shape(), inputs[2].shape(), inputs[3].shape(),
                                 inputs[4].shape(), inputs[8].shape()},
                                std::vector<mx::Dtype>(6, mx::float32), std::make_shared<GatedDeltaGrad>(s, cfg), in);
}

void gd_check(const mx::array& q, const mx::array& k, const mx::array& v, const mx::array& g, const mx::array& beta,
              const mx::array& starts, int chunk) {
  const bool ok = q.ndim() == 4 && k.shape() == q.shape() && v.ndim() == 4 && v.shape(0) == q.shape(0) &&
                  v.shape(1) == q.shape(1) && q.shape(2) > 0 && v.shape(2) % q.shape(2) == 0 &&
                  g.shape() == mx::Shape{v.shape(0), v.shape(1), v.shape(2)} && beta.shape() == g.shape() &&
                  starts.shape() == mx::Shape{q.shape(0), q.shape(1)} && chunk > 0;
  if (!ok)
    throw std::invalid_argument("gated_delta: q, k [B, T, Hk, dk], v [B, T, Hv, dv] (Hv a multiple of Hk), g and "
                                "beta [B, T, Hv], doc_starts [B, T] and chunk > 0 expected.");
}

GdConfig gd_config(int chunk, float scale, bool l2norm) { return GdConfig{chunk, scale, l2norm}; }

std::vector<mx::array> gated_delta_op(const mx::array& q, const mx::array& k, const mx::array& v, const mx::array& g,
                                      const mx::array& beta, const mx::array& state, const mx::array& starts,
                                      int chunk, float scale, bool l2norm) {
  auto s = cpu_stream({&q, &k, &v, &g, &beta, &state});
  gd_check(q, k, v, g, beta, starts, chunk);
  if (state.shape() != mx::Shape{q.shape(0), v.shape(2), q.shape(3), v.shape(3)})
    throw std::invalid_argument("gated_delta: initial state [B, Hv, dk, dv] expected.");
  std::vector<mx::array> in{dense(q, s), dense(k, s), dense(v, s), dense(g, s), dense(beta, s), dense(state, s),
                            dense(mx::astype(starts, mx::bool_, s), s)};
  auto prim = std::make_shared<GatedDelta>(s, gd_config(chunk, scale, l2norm));
  auto shapes = prim->output_shapes(in);
  return mx::array::make_arrays(shapes, {mx::float32, mx::float32, mx::float32}, prim, in);
}

std::vector<mx::array> gated_delta_backward_op(const mx::array& q, const mx::array& k, const mx::array& v,
                                               const mx::array& g, const mx::array& beta, const mx::array& starts,
                                               const mx::array& saved, const mx::array& d_out,
                                               const mx::array& d_final, int chunk, float scale, bool l2norm) {
  auto s = cpu_stream({&q, &k, &v, &g, &beta, &saved});
  gd_check(q, k, v, g, beta, starts, chunk);
  const GdDims d(q, v, chunk);
  if (saved.shape() != mx::Shape{d.N, d.B, d.Hv, d.dk, d.dv})
    throw std::invalid_argument("gated_delta_grad: saved states [N, B, Hv, dk, dv] expected.");
  const mx::Shape fin{d.B, d.Hv, d.dk, d.dv};
  return gated_delta_grad_op({q, k, v, g, beta, mx::astype(starts, mx::bool_, s), saved,
                              mx::broadcast_to(mx::astype(d_out, mx::float32, s), v.shape(), s),
                              mx::broadcast_to(mx::astype(d_final, mx::float32, s), fin, s)},
                             gd_config(chunk, scale, l2norm), s);
}

}  // namespace
