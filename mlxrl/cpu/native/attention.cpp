// FlashAttention, forward and backward, as two MLX primitives.
//
// Attention without the score square (FlashAttention's memory shape): per (batch, kv-head) and block of
// queries, the keys in chunks of kKeyChunk: the block's scores against a chunk stay in a per-worker buffer
// (64 rows x 256 keys, 64 KB: in L2), an online softmax runs over them in place (each row's running max and
// sum; o rescaled when the max grows) and P V accumulates; only the output and each row's log-sum-exp are
// written (a whole row of scores, 1 MB at 4096 keys, ran slower: the figures in docs/benchmarks.md). The backward
// recomputes P = exp(S - lse) per block and builds dq, dk, dv with the same tiles. The matmuls are the
// register-tiled micro-kernel `mk_mm` (microkernel.h: the C tile in registers in the machine's vector width; here
// B packed in panels of 32 columns, k blocked by 128 so a panel block stays in L1): the BLAS would pack and zero
// more than it multiplies at these sizes (K = head_dim = 64-128), and each call would send the block's scores
// through memory.

#include "common.h"
#include "microkernel.h"

namespace {

// A primitive with a causal flag; its name, which is_equivalent compares, carries the flag.
template <class Base>
class WithCausal : public Base {
 public:
  WithCausal(mx::Stream s, bool causal, const char* plain, const char* masked)
      : Base(s), causal_(causal), names_{plain, masked} {}
  const char* name() const override { return names_[causal_ ? 1 : 0]; }

 protected:
  bool causal_;

 private:
  const char* names_[2];
};

constexpr int kPanel = 32;                                          // packed B panels: 32 columns
constexpr int kDepth = 128;                                         // k per pass over a panel

// C[M, N] (+)= A[M, K] B[K, N]: A(i, k) = a[i ai + k ak]; B(k, j) = b[(j / kPanel) panel + k ldb + j % kPanel]:
// panels packed by pack_panels (ldb = kPanel, panel = K kPanel) or a row-major matrix (ldb its row stride,
// panel = kPanel; its rows readable up to N); N a multiple of 16, C's rows ldc apart.
void panel_gemm(int M, int N, int K, const float* a, size_t ai, size_t ak, const float* b, size_t ldb, size_t panel,
                float* c, size_t ldc, bool acc) {
  if (K == 0) {
    if (!acc)
      for (int i = 0; i < M; ++i) std::fill(c + i * ldc, c + i * ldc + N, 0.0f);
    return;
  }
  for (int k0 = 0; k0 < K; k0 += kDepth) {
    const int kk = std::min(kDepth, K - k0);
    const bool add = acc || k0 > 0;
    for (int j0 = 0; j0 < N; j0 += kPanel) {
      const float* bp = b + size_t(j0 / kPanel) * panel + size_t(k0) * ldb;
      const float* ap = a + size_t(k0) * ak;
      mk_mm(M, std::min(kPanel, N - j0), kk, ap, ai, ak, bp, ldb, c + j0, ldc, add);
    }
  }
}

// Packs B(k, j) = src[k sk + j sj] (k < K, j < N) into panels of kPanel columns, K rows each, zero past N.
void pack_panels(const float* src, size_t sk, size_t sj, int K, int N, float* dst) {
  const int panels = int(round_up(N, kPanel) / kPanel);
  for (int p = 0; p < panels; ++p) {
    float* d = dst + size_t(p) * K * kPanel;
    for (int k = 0; k < K; ++k)
      for (int jj = 0; jj < kPanel; ++jj) {
        const int j = p * kPanel + jj;
        d[size_t(k) * kPanel + jj] = j < N ? src[k * sk + j * sj] : 0.0f;
      }
  }
}

// Keys per pass of both attention kernels: a block's [rows, chunk] scores and, in the backward, a chunk's
// [Dp, chunk] dk^T / dv^T stay in L2.
constexpr int kKeyChunk = 256;

// Rows per block: the forward's blocks are large, so each chunk of k / v (streamed from beyond L2: 4 MB packed
// per group at 4096 keys) serves more rows before the next, halved while there would be fewer than 4 blocks a
// worker; the backward's stay at 64 (its dk / dv chunks are the reused side). The figures behind both sizes:
// docs/benchmarks.md.
constexpr int kForwardRows = 512;
constexpr int kBackwardRows = 64;

// q [B, G, rep, L, D] (scaled), k / v [B, G, S, D]: G kv-heads, each shared by rep query heads; causal:
// query i sees keys j <= i + S - L. A block is bq queries of every head of a group, stacked as rep x bq
// rows (row h bq + t is query r0 + t of head h), so the group's k / v panels serve ~`target` rows at a time.
struct AttnDims {
  int B, G, rep, L, S, D;
  bool causal;
  int Dp, bq, rows, blocks;
  int chunk;   // keys per pass (kKeyChunk, fewer for short rows): a multiple of kPanel
  size_t ldc;  // the score buffers' row stride: past a multiple of the cache's alias stride
  AttnDims(const mx::array& q, const mx::array& k, bool c, int target)
      : B(q.shape(0)), G(q.shape(1)), rep(q.shape(2)), L(q.shape(3)), S(k.shape(2)), D(q.shape(4)), causal(c) {
    Dp = int(round_up(D, 16));
    const size_t groups = size_t(B) * G, enough = 4 * size_t(worker_count());
    for (; target > 64; target /= 2) {  // fewer rows while the blocks would not keep every worker busy
      const int b = std::max(1, target / std::max(1, rep));
      if (groups * ((size_t(L) + b - 1) / b) >= enough) break;
    }
    bq = std::max(1, target / std::max(1, rep));
    bq = std::min(bq, std::max(1, L));
    rows = rep * bq;
    blocks = L == 0 ? 0 : (L + bq - 1) / bq;
    chunk = std::min(kKeyChunk, int(round_up(std::max(S, 1), kPanel)));
    ldc = size_t(chunk) + 16;
  }
  int seen(int r1) const { return causal ? std::min(S, r1 + S - L) : S; }  // keys a block ending at r1 sees
  int limit(int i) const { return causal ? std::min(S, i + S - L + 1) : S; }  // keys query i sees
};

// The keys [start, end) batch row b attends to (bounds int32 [B, 2]; none: all S), clamped to [0, S].
struct KeyWindow {
  int start, end;
  KeyWindow(const int32_t* bounds, int b, int S)
      : start(bounds ? std::clamp(bounds[2 * b], 0, S) : 0),
        end(bounds ? std::clamp(bounds[2 * b + 1], start, S) : S) {}
};

// The rows of block [r0, r1) of one group of x [.., rep, L, D] (group offset x0) into tile [rep n, Dp]
// (zero past D), and back (first D columns, row i times scale[i] when scale is given).
void gather_rows(const AttnDims& d, const float* x0, int r0, int n, float* tile) {
  for (int h = 0; h < d.rep; ++h)
    for (int t = 0; t < n; ++t) {
      const float* src = x0 + (size_t(h) * d.L + r0 + t) * d.D;
      float* dst = tile + size_t(h * n + t) * d.Dp;
      std::copy(src, src + d.D, dst);
      std::fill(dst + d.D, dst + d.Dp, 0.0f);
    }
}

void scatter_rows(const AttnDims& d, const float* tile, int r0, int n, float* x0, const float* scale) {
  for (int h = 0; h < d.rep; ++h)
    for (int t = 0; t < n; ++t) {
      const int i = h * n + t;
      const float* src = tile + size_t(i) * d.Dp;
      float* dst = x0 + (size_t(h) * d.L + r0 + t) * d.D;
      if (scale == nullptr) {
        std::copy(src, src + d.D, dst);
      } else {
        const float s = scale[i];
#pragma omp simd
        for (int c = 0; c < d.D; ++c) dst[c] = src[c] * s;
      }
    }
}

// x0's rows of block [r0, r1) += tile's (first D columns).
void add_rows(const AttnDims& d, const float* tile, int r0, int n, float* x0) {
  for (int h = 0; h < d.rep; ++h)
    for (int t = 0; t < n; ++t) {
      const float* src = tile + size_t(h * n + t) * d.Dp;
      float* dst = x0 + (size_t(h) * d.L + r0 + t) * d.D;
#pragma omp simd
      for (int c = 0; c < d.D; ++c) dst[c] += src[c];
    }
}

std::vector<mx::array> flash_attention_grad_op(const std::vector<mx::array>& inputs, bool causal, mx::Stream s);

// inputs q, k, v[, bounds]; outputs o [B, G, rep, L, D], lse [B, G, rep, L]. bounds int32 [B, 2]: batch row b
// sees keys [start, end) only (a padded row's keys); a query that sees no key gets o = 0 and lse = -inf.
class FlashAttention : public WithCausal<CpuPrimitive> {
 public:
  FlashAttention(mx::Stream s, bool causal)
      : WithCausal(s, causal, "MlxrlFlashAttention", "MlxrlCausalFlashAttention") {}
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto lse = inputs[0].shape();
    lse.pop_back();
    return {inputs[0].shape(), lse};
  }
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    encode_outputs(stream(), inputs, outputs).dispatch([d = AttnDims(inputs[0], inputs[1], causal_, kForwardRows), qp = inputs[0].data<float>(),
                      kp = inputs[1].data<float>(), vp = inputs[2].data<float>(), op = outputs[0].data<float>(),
                      lp = outputs[1].data<float>(), bp = inputs.size() > 3 ? inputs[3].data<int32_t>() : nullptr]() {
      const size_t heads = size_t(d.B) * d.G;
      if (heads == 0 || d.blocks == 0) return;
      const size_t kt_size = size_t(d.D) * round_up(d.S, kPanel), v_size = size_t(d.S) * round_up(d.Dp, kPanel);
      const size_t workers = std::min<size_t>(worker_count(), heads * d.blocks);
      Scratch scratch;
      float* kt = scratch.take(heads * kt_size);  // k^T per group: panels of D rows x 32 keys
      float* vpk = scratch.take(heads * v_size);  // v per group: panels of S rows x 32 columns
      std::vector<float*> qtile(workers), stile(workers), otile(workers), mtile(workers), ltile(workers), atile(workers);
      for (size_t w = 0; w < workers; ++w) {
        qtile[w] = scratch.take(size_t(d.rows) * d.Dp);
        otile[w] = scratch.take(size_t(d.rows) * d.Dp);
        stile[w] = scratch.take(size_t(d.rows) * d.ldc);
        mtile[w] = scratch.take(size_t(d.rows));  // each row's running max, sum and the chunk's rescale
        ltile[w] = scratch.take(size_t(d.rows));
        atile[w] = scratch.take(size_t(d.rows));
      }
      parallel_items(heads, workers, [&](size_t, size_t g) {
        const float* k0 = kp + g * d.S * d.D;
        pack_panels(k0, 1, d.D, d.D, d.S, kt + g * kt_size);
        pack_panels(vp + g * d.S * d.D, d.D, 1, d.S, d.D, vpk + g * v_size);
      });
      // items: (group, block), the blocks that see the most keys first. Per block, the keys in chunks with a
      // running max and sum per row (FlashAttention's online softmax): o is rescaled when the max grows.
      const size_t items = heads * d.blocks;
      parallel_items(items, workers, [&](size_t w, size_t item) {
        const size_t g = item % heads;
        const KeyWindow win(bp, int(g / d.G), d.S);
        const int blk = d.causal ? d.blocks - 1 - int(item / heads) : int(item / heads);
        const int r0 = blk * d.bq, n = std::min(d.bq, d.L - r0), rows = d.rep * n;
        const int seen = std::min(win.end, d.seen(r0 + n));
        const size_t group = g * d.rep * d.L;  // the group's first row of q / o / lse
        float *qt = qtile[w], *st = stile[w], *ot = otile[w], *m = mtile[w], *l = ltile[w], *alpha = atile[w];
        gather_rows(d, qp + group * d.D, r0, n, qt);
        std::fill(m, m + rows, -std::numeric_limits<float>::infinity());
        std::fill(l, l + rows, 0.0f);
        bool first = true;
        for (int j0 = win.start / kPanel * kPanel; j0 < seen; j0 += d.chunk) {
          const int cnt = std::min(seen, j0 + d.chunk) - j0, ncols = int(round_up(cnt, 16));
          panel_gemm(rows, ncols, d.D, qt, d.Dp, 1, kt + g * kt_size + size_t(j0 / kPanel) * d.D * kPanel, kPanel,
                     size_t(d.D) * kPanel, st, d.ldc, false);
          for (int i = 0; i < rows; ++i) {
            const int t = i % n;
            const int lo = std::max(win.start, j0) - j0, hi = std::min({win.end, d.limit(r0 + t), j0 + cnt}) - j0;
            float* x = st + size_t(i) * d.ldc;
            alpha[i] = 1.0f;
            if (hi <= lo) {  // no key of this chunk
              std::fill(x, x + ncols, 0.0f);
              continue;
            }
            const float mn = std::max(m[i], row_max(x + lo, hi - lo));
            const float sum = exp_shift_sum(x + lo, x + lo, hi - lo, mn);
            std::fill(x, x + lo, 0.0f);
            std::fill(x + hi, x + ncols, 0.0f);
            alpha[i] = std::exp(m[i] - mn);  // 0 while the row had no key
            l[i] = l[i] * alpha[i] + sum;
            m[i] = mn;
          }
          if (!first)
            for (int i = 0; i < rows; ++i)
              if (alpha[i] != 1.0f) {
                float* o = ot + size_t(i) * d.Dp;
#pragma omp simd
                for (int c = 0; c < d.Dp; ++c) o[c] *= alpha[i];
              }
          panel_gemm(rows, d.Dp, cnt, st, d.ldc, 1, vpk + g * v_size + size_t(j0) * kPanel, kPanel,
                     size_t(d.S) * kPanel, ot, d.Dp, !first);
          first = false;
        }
        if (first) std::fill(ot, ot + size_t(rows) * d.Dp, 0.0f);  // the block sees no key
        for (int i = 0; i < rows; ++i) {
          const int h = i / n, t = i % n;
          lp[group + size_t(h) * d.L + r0 + t] = l[i] > 0.0f ? m[i] + std::log(l[i]) : -std::numeric_limits<float>::infinity();
          l[i] = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;  // no key: o = 0
        }
        scatter_rows(d, ot, r0, n, op + group * d.D, l);
      });
    });
  }
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>& outputs) override {
    auto s = stream();
    std::vector<mx::array> in{primals[0], primals[1], primals[2], outputs[0], outputs[1],
                              mx::astype(cotangents[0], mx::float32, s), mx::astype(cotangents[1], mx::float32, s)};
    if (primals.size() > 3) in.push_back(primals[3]);
    auto grads = flash_attention_grad_op(in, causal_, s);
    std::vector<mx::array> out;
    for (int a : argnums) out.push_back(a < 3 ? grads[a] : mx::zeros_like(primals[a], s));
    return out;
  }
};

// inputs q, k, v, o, lse, dO, dlse[, bounds]; outputs dq, dk, dv. Per group (one worker each): k^T, k and v^T
// packed once; then per chunk of kKeyChunk keys, every block of queries that sees one of them: P = exp(S - lse),
// dP = dO v^T, dS = P (dP - rowsum(dO o) + dlse), dq += dS k, dv += P^T dO, dk += dS^T q (d lse / dS = P: the
// cotangent of lse adds to every key's term). The backward needs no softmax statistic beyond lse, so the keys
// split freely: a chunk's dk^T / dv^T ([Dp, chunk]) and the block's P / dS ([rows, chunk]) stay in L2 while the
// blocks accumulate into them, where [Dp, S] ones (2 MB each at 4096 keys) went to L3 and back once per block
// (the figures: docs/benchmarks.md).

class FlashAttentionGrad : public WithCausal<CpuPrimitive> {
 public:
  FlashAttentionGrad(mx::Stream s, bool causal)
      : WithCausal(s, causal, "MlxrlFlashAttentionGrad", "MlxrlCausalFlashAttentionGrad") {}
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape(), inputs[1].shape(), inputs[2].shape()};
  }
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    encode_outputs(stream(), inputs, outputs).dispatch([d = AttnDims(inputs[0], inputs[1], causal_, kBackwardRows), qp = inputs[0].data<float>(),
                      kp = inputs[1].data<float>(), vp = inputs[2].data<float>(), op = inputs[3].data<float>(),
                      lp = inputs[4].data<float>(), gp = inputs[5].data<float>(), dlp = inputs[6].data<float>(),
                      bp = inputs.size() > 7 ? inputs[7].data<int32_t>() : nullptr, dq = outputs[0].data<float>(),
                      dk = outputs[1].data<float>(), dv = outputs[2].data<float>()]() {
      const size_t heads = size_t(d.B) * d.G;
      if (heads == 0) return;
      const size_t SD = size_t(d.S) * d.D;
      std::fill(dq, dq + heads * d.rep * size_t(d.L) * d.D, 0.0f);  // accumulated over the chunks
      if (d.blocks == 0) {  // no queries: no gradient for k, v
        std::fill(dk, dk + heads * SD, 0.0f);
        std::fill(dv, dv + heads * SD, 0.0f);
        return;
      }
      const int chunk = d.chunk;
      const size_t Spad = round_up(d.S, kPanel), Dpp = round_up(d.Dp, kPanel), ldc = d.ldc;
      const size_t workers = std::min<size_t>(worker_count(), heads);
      Scratch scratch;
      struct Work {
        float *kt, *kk, *vt, *dkt, *dvt, *qt, *gt, *st, *pt, *dqt, *delta;
      };
      std::vector<Work> work(workers);
      for (auto& w : work) {
        w.kt = scratch.take(size_t(d.D) * Spad);    // k^T panels (scores)
        w.vt = scratch.take(size_t(d.D) * Spad);    // v^T panels (dP)
        w.kk = scratch.take(size_t(d.S) * Dpp);     // k panels (dq)
        w.dkt = scratch.take(size_t(d.Dp) * ldc);  // the chunk's dk^T, dv^T [Dp, chunk]: P / dS rows are B
        w.dvt = scratch.take(size_t(d.Dp) * ldc);
        w.qt = scratch.take(size_t(d.rows) * d.Dp);
        w.gt = scratch.take(size_t(d.rows) * d.Dp);
        w.st = scratch.take(size_t(d.rows) * ldc);  // scores, then P
        w.pt = scratch.take(size_t(d.rows) * ldc);  // dP, then dS
        w.dqt = scratch.take(size_t(d.rows) * d.Dp);
        w.delta = scratch.take(size_t(d.rep) * d.L);  // the group's rows' rowsum(dO o) - dlse
      }
      parallel_items(heads, workers, [&](size_t wi, size_t g) {
        Work& w = work[wi];
        const float *k0 = kp + g * SD, *v0 = vp + g * SD;
        pack_panels(k0, 1, d.D, d.D, d.S, w.kt);
        pack_panels(v0, 1, d.D, d.D, d.S, w.vt);
        pack_panels(k0, d.D, 1, d.S, d.D, w.kk);
        const size_t group = g * d.rep * d.L;
        const KeyWindow win(bp, int(g / d.G), d.S);
        float *dkg = dk + g * SD, *dvg = dv + g * SD;
        for (size_t i = 0; i < size_t(d.rep) * d.L; ++i) {  // once per row, not per chunk
          const float *orow = op + (group + i) * d.D, *grow = gp + (group + i) * d.D;
          float s = 0.0f;
#pragma omp simd reduction(+ : s)
          for (int c = 0; c < d.D; ++c) s += orow[c] * grow[c];
          w.delta[i] = s - dlp[group + i];
        }
        for (int j0 = 0; j0 < d.S; j0 += chunk) {
          const int j1 = std::min(d.S, j0 + chunk);
          std::fill(w.dkt, w.dkt + size_t(d.Dp) * ldc, 0.0f);
          std::fill(w.dvt, w.dvt + size_t(d.Dp) * ldc, 0.0f);
          for (int blk = d.blocks - 1; blk >= 0 && j1 > win.start; --blk) {
            const int r0 = blk * d.bq, n = std::min(d.bq, d.L - r0), rows = d.rep * n;
            const int cnt = std::min({win.end, d.seen(r0 + n), j1}) - j0;  // the chunk's keys the block sees
            if (cnt <= 0) {
              if (d.causal) break;  // the blocks above see fewer keys
              continue;
            }
            const int ncols = int(round_up(cnt, 16));
            gather_rows(d, qp + group * d.D, r0, n, w.qt);
            gather_rows(d, gp + group * d.D, r0, n, w.gt);
            const size_t panel0 = size_t(j0 / kPanel) * d.D * kPanel;  // the chunk's first k^T / v^T panel
            panel_gemm(rows, ncols, d.D, w.qt, d.Dp, 1, w.kt + panel0, kPanel, size_t(d.D) * kPanel, w.st, ldc, false);
            panel_gemm(rows, ncols, d.D, w.gt, d.Dp, 1, w.vt + panel0, kPanel, size_t(d.D) * kPanel, w.pt, ldc, false);
            for (int i = 0; i < rows; ++i) {
              const int h = i / n, t = i % n;
              const int lo = std::max(win.start, j0) - j0, hi = std::min({win.end, d.limit(r0 + t), j1}) - j0;
              const size_t row = size_t(h) * d.L + r0 + t;  // within the group
              const float l = lp[group + row], de = w.delta[row];
              float* x = w.st + size_t(i) * ldc;
              float* y = w.pt + size_t(i) * ldc;
              if (hi <= lo) {  // no key here: P = dS = 0
                std::fill(x, x + ncols, 0.0f);
                std::fill(y, y + ncols, 0.0f);
                continue;
              }
              std::fill(x, x + lo, 0.0f);
              std::fill(y, y + lo, 0.0f);
              int j = lo;
              for (; j + 16 <= hi; j += 16) {
                const vf16 p = vexp(load16(x + j) - l);
                store16(x + j, p);
                store16(y + j, p * (load16(y + j) - de));
              }
              for (; j < hi; ++j) {
                const float p = fast_exp(x[j] - l);
                x[j] = p;
                y[j] = p * (y[j] - de);
              }
              std::fill(x + hi, x + ncols, 0.0f);  // read as B up to ncols below
              std::fill(y + hi, y + ncols, 0.0f);
            }
            // dq += dS k
            panel_gemm(rows, d.Dp, cnt, w.pt, ldc, 1, w.kk + size_t(j0) * kPanel, kPanel, size_t(d.S) * kPanel, w.dqt,
                       d.Dp, false);
            add_rows(d, w.dqt, r0, n, dq + group * d.D);
            // dv^T += dO^T P, dk^T += q^T dS: A the block's dO / q read transposed (in L1), B the rows of P / dS
            panel_gemm(d.Dp, ncols, rows, w.gt, 1, d.Dp, w.st, ldc, kPanel, w.dvt, ldc, true);
            panel_gemm(d.Dp, ncols, rows, w.qt, 1, d.Dp, w.pt, ldc, kPanel, w.dkt, ldc, true);
          }
          for (int j = j0; j < j1; ++j)
            for (int c = 0; c < d.D; ++c) {
              dkg[size_t(j) * d.D + c] = w.dkt[c * ldc + j - j0];
              dvg[size_t(j) * d.D + c] = w.dvt[c * ldc + j - j0];
            }
        }
      });
    });
  }
};

std::vector<mx::array> flash_attention_grad_op(const std::vector<mx::array>& inputs, bool causal, mx::Stream s) {
  std::vector<mx::array> dense_inputs;
  for (auto& a : inputs) dense_inputs.push_back(dense(a, s));  // (dO and dlse: float32 already)
  return mx::array::make_arrays({inputs[0].shape(), inputs[1].shape(), inputs[2].shape()},
                                {mx::float32, mx::float32, mx::float32},
                                std::make_shared<FlashAttentionGrad>(s, causal), dense_inputs);
}

std::vector<mx::array> flash_attention_op(const mx::array& q, const mx::array& k, const mx::array& v, bool causal,
                                          const std::optional<mx::array>& bounds, mx::StreamOrDevice s = {}) {
  auto stream = cpu_stream({&q, &k, &v}, s);
  if (q.ndim() != 5 || k.ndim() != 4 || v.shape() != k.shape() || q.shape(0) != k.shape(0) ||
      q.shape(1) != k.shape(1) || q.shape(4) != k.shape(3))
    throw std::invalid_argument("flash_attention: q [B, G, rep, L, D], k and v [B, G, S, D] expected.");
  if (causal && q.shape(3) > k.shape(2))
    throw std::invalid_argument("flash_attention: causal attention needs L <= S (queries are the last L keys).");
  std::vector<mx::array> in{dense(q, stream), dense(k, stream), dense(v, stream)};
  if (bounds) {
    if (bounds->ndim() != 2 || bounds->shape(0) != q.shape(0) || bounds->shape(1) != 2)
      throw std::invalid_argument("flash_attention: bounds are [B, 2] (each row's first and past-last key).");
    in.push_back(dense(mx::astype(*bounds, mx::int32, stream), stream));
  }
  auto lse = q.shape();
  lse.pop_back();
  return mx::array::make_arrays({q.shape(), lse}, {mx::float32, mx::float32},
                                std::make_shared<FlashAttention>(stream, causal), in);
}

}  // namespace
