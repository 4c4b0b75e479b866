// mlxrl's native CPU kernels as the Python module `_cpu_math` (every binding is below), and the one translation
// unit that mlxrl.cpu.native compiles: it #includes each kernel family's source, and each of those the shared
// header, so that the flags and the inlining are those of one file. The sources:
//
//   common.h         includes, the vectorised exp, threading, the helpers every primitive shares
//   microkernel.h    the small products' register-tiled micro-kernel (attention.cpp, gated_delta.cpp)
//   elementwise.cpp  exp, sigmoid, softmax over the last axis and the softmax's VJP
//   optimizers.cpp   sum of squares (the gradient norm), the AdamW step, 8-bit blockwise AdamW
//   fused_head.cpp   the fused LM head: the tile pass, a frozen head's one pass over vocabulary blocks
//   dropout.cpp      counter-hash dropout, LoRA's dropout + down-projection
//   layers.cpp       RMSNorm, LayerNorm, rotary embedding, the SwiGLU product, GELU's tanh form
//   attention.cpp    FlashAttention, forward and backward
//   gated_delta.cpp  the gated delta rule of Qwen3.5's linear attention, forward and backward
//   causal_conv.cpp  its causal convolution with the SiLU, split into q / k / v, and the VJP
//   experts.cpp      a mixture-of-experts layer's gathered matmuls, one GEMM per expert
//
// Every kernel is an MLX primitive, float32, on the CPU; each family's helpers live in an anonymous namespace
// (one translation unit: nothing but the module's entry point is exported).

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include "common.h"

#include "elementwise.cpp"
#include "optimizers.cpp"
#include "fused_head.cpp"
#include "dropout.cpp"
#include "layers.cpp"
#include "attention.cpp"
#include "gated_delta.cpp"
#include "causal_conv.cpp"
#include "experts.cpp"

namespace nb = nanobind;

NB_MODULE(_cpu_math, m) {
  m.doc() = "mlxrl's vectorised, multi-threaded CPU kernels (float32): exp, sigmoid, softmax (last axis), "
            "sum of squares, the AdamW step, the fused LM head, dropout (and LoRA's dropout + down-projection), "
            "RMSNorm, rotary embedding, SwiGLU, FlashAttention, the gated delta rule and its causal convolution.";
  m.def("drain_bytes", &drain_bytes,
        "Output size from which a kernel finishes the stream's queued work before allocating (MLXRL_DRAIN_BYTES).");
  m.def("exp", [](const mx::array& x) { return fast_exp_op(x); }, nb::arg("x"));
  m.def("sigmoid", [](const mx::array& x) { return fast_sigmoid_op(x); }, nb::arg("x"));
  m.def("softmax", [](const mx::array& x) { return fast_softmax_op(x); }, nb::arg("x"), "Softmax over the last axis.");
  m.def("softmax_grad", [](const mx::array& y, const mx::array& g) { return softmax_grad_op(y, g); }, nb::arg("y"),
        nb::arg("g"), "The softmax's VJP from its output y and cotangent g: y (g - sum(g y, -1)).");
  m.def("adamw_step", &adamw_step_op, nb::arg("g"), nb::arg("w"), nb::arg("m"), nb::arg("v"), nb::arg("hyper"),
        nb::arg("weight_decay"), nb::arg("beta1"), nb::arg("beta2"), nb::arg("eps"),
        "One AdamW step (torch's arithmetic); hyper = [grad scale, lr, 1/(1-b1^t), 1/sqrt(1-b2^t)]. "
        "Returns (w, m, v).");
  m.def("adamw8_step", &adamw8_step_op, nb::arg("g"), nb::arg("w"), nb::arg("m_codes"), nb::arg("m_max"),
        nb::arg("v_codes"), nb::arg("v_max"), nb::arg("maps"), nb::arg("luts"), nb::arg("hyper"),
        nb::arg("weight_decay"),
        nb::arg("beta1"), nb::arg("beta2"), nb::arg("eps"),
        "One 8-bit blockwise AdamW step (bitsandbytes' scheme; hyper as adamw_step). Returns (w, m codes, m "
        "maxima, v codes, v maxima).");
  m.def("sum_squares", &sum_squares_op, nb::arg("x"), "sum(x^2) as a float32 scalar (accumulated in double).");
  m.def("fused_head", &fused_head_op, nb::arg("h"), nb::arg("weight"), nb::arg("targets"), nb::arg("w"),
        nb::arg("inv_t"), nb::arg("mode"), nb::arg("chunk_rows"), nb::arg("with_entropy"), nb::arg("weight_grad"),
        "The LM head and a token-separable loss (mode 0 nll, 1 dft) over row chunks: (loss, logp, entropy, "
        "argmax, d_hidden, d_weight), the gradients of loss = sum w_i l_i.");
  m.def("dropout", [](const mx::array& x, const mx::array& key, float keep) { return dropout_op(x, key, keep); },
        nb::arg("x"), nb::arg("key"), nb::arg("keep"),
        "x * mask / keep with mask_i = hash(key, i) < keep (a uint32[2] key: the same key, the same mask).");
  m.def("lora_down", [](const mx::array& x, const mx::array& key, const mx::array& a, float keep) {
          return lora_down_op(x, key, a, keep);
        }, nb::arg("x"), nb::arg("key"), nb::arg("a"), nb::arg("keep"),
        "dropout(x, key, keep) @ a for a LoRA adapter's a [d, r], without the dropout copy (dropout's mask).");
  m.def("rms_norm", [](const mx::array& x, const mx::array& w, float eps) { return rms_norm_op(x, w, eps); },
        nb::arg("x"), nb::arg("weight"), nb::arg("eps"), "RMSNorm over the last axis: x / sqrt(mean(x^2) + eps) * weight.");
  m.def("rotary", [](const mx::array& x, const mx::array& cos, const mx::array& sin) {
          return rotary_op(x, cos, sin, false);
        }, nb::arg("x"), nb::arg("cos"), nb::arg("sin"),
        "Rotary embedding of x [B, H, L, D] (any strides): x cos + rotate_half(x) sin, cos / sin broadcast to x.");
  m.def("gelu_tanh", [](const mx::array& x) { return gelu_tanh_op(x); }, nb::arg("x"),
        "GELU's tanh approximation, x sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3)).");
  m.def("layer_norm", [](const mx::array& x, const mx::array& w, const mx::array& b, float eps) {
          return layer_norm_op(x, w, b, eps);
        }, nb::arg("x"), nb::arg("weight"), nb::arg("bias"), nb::arg("eps"),
        "LayerNorm over the last axis: (x - mean) / sqrt(var + eps) * weight + bias.");
  m.def("silu_mul", [](const mx::array& g, const mx::array& u) { return silu_mul_op(g, u); }, nb::arg("g"),
        nb::arg("u"), "silu(g) * u (the SwiGLU product).");
  m.def("flash_attention", [](const mx::array& q, const mx::array& k, const mx::array& v, bool causal,
                              const std::optional<mx::array>& bounds, bool return_lse) -> nb::object {
          auto out = flash_attention_op(q, k, v, causal, bounds);
          return return_lse ? nb::cast(out) : nb::cast(out[0]);
        }, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("causal"), nb::arg("bounds") = nb::none(),
        nb::arg("return_lse") = false,
        "softmax(q k^T) v for scaled q [B, G, rep, L, D] and k / v [B, G, S, D] without the score square "
        "(causal: query i sees keys j <= i + S - L; bounds int32 [B, 2]: row b sees keys [start, end) only, "
        "a query seeing none gives 0 and lse -inf); return_lse: [o, the rows' log-sum-exp [B, G, rep, L]], "
        "both differentiable. Its VJP recomputes the scores per block of queries.");
  m.def("flash_attention_grad", [](const mx::array& q, const mx::array& k, const mx::array& v, const mx::array& o,
                                   const mx::array& lse, const mx::array& d_out, const mx::array& d_lse, bool causal,
                                   const std::optional<mx::array>& bounds) {
          auto s = cpu_stream({&q, &k, &v, &o, &lse});
          std::vector<mx::array> in{q, k, v, o, lse, mx::astype(d_out, mx::float32, s), mx::astype(d_lse, mx::float32, s)};
          if (bounds) in.push_back(mx::astype(*bounds, mx::int32, s));
          return flash_attention_grad_op(in, causal, s);
        }, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("o"), nb::arg("lse"), nb::arg("d_out"), nb::arg("d_lse"),
        nb::arg("causal"), nb::arg("bounds") = nb::none(),
        "flash_attention's VJP from its inputs, outputs (o, lse) and their cotangents: [dq, dk, dv] (the scores "
        "recomputed per block of queries, as in the backward of flash_attention).");
  m.def("gated_delta", &gated_delta_op, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("g"), nb::arg("beta"),
        nb::arg("state"), nb::arg("starts"), nb::arg("chunk"), nb::arg("scale"), nb::arg("l2norm"),
        "The gated delta rule over a sequence (mlxrl.models.gated_delta's chunked form; float32 q, k [B, T, Hk, dk], "
        "v [B, T, Hv, dv], g, beta [B, T, Hv], state [B, Hv, dk, dv], starts bool [B, T]): [out, final state, the "
        "states at the chunk starts [N, B, Hv, dk, dv]].");
  m.def("gated_delta_grad", &gated_delta_backward_op, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("g"),
        nb::arg("beta"), nb::arg("starts"), nb::arg("saved"), nb::arg("d_out"), nb::arg("d_final"), nb::arg("chunk"),
        nb::arg("scale"), nb::arg("l2norm"),
        "gated_delta's VJP from its inputs, the saved chunk-start states and the cotangents of (out, final state): "
        "[dq, dk, dv, dg, dbeta, d_state], each chunk recomputed from its start state, last chunk first.");
  m.def("causal_conv_silu", &causal_conv_silu_op, nb::arg("x"), nb::arg("weight"), nb::arg("state"), nb::arg("starts"),
        nb::arg("widths"), nb::arg("documents"),
        "silu(depthwise causal conv over time) of x [B, L, C] with weight [C, 1, K], the K - 1 rows before x (state "
        "[B, K - 1, C]) and, when documents, the document starts (bool [B, L]: no tap crosses a start, the state "
        "is not read), split into parts [B, L, width] side by side: [*parts, the last K - 1 rows of (state, x)].");
  m.def("expert_matmul", &expert_matmul_op, nb::arg("x"), nb::arg("w"), nb::arg("experts"),
        "x [M, in] rows sorted by expert times their expert's w [E, out, in] transposed: [M, out], one GEMM per "
        "expert (experts [M], non-decreasing), differentiable in x and w; a bfloat16 w (a kept frozen stack) is "
        "widened one expert's matrix at a time.");
  m.def("threads", &worker_count);
}
