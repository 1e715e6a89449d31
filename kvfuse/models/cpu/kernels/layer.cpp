// The two halves of a transformer layer around attention, each one call: what the runner's
// ``project`` and ``post_attention`` compute, for projections in blocks (linear.cpp) on float32
// rows. A single-stream decode step spends a few milliseconds in the Python and operator
// dispatch between its ~15 small operations per layer (a step of SmolLM2 is ~30-40 ms, most of it
// streaming the weights); here they run back to back in C++ with the same kernels and the same
// arithmetic, so the results are those of the step-by-step path.

#include "kernels.h"

namespace {

torch::Tensor product(const torch::Tensor& x, const BlockedArg& w,
                      const c10::optional<torch::Tensor>& bias) {
  if (!w.parts.empty()) return ggml_linear(x, w.parts, w.types, bias);
  return blocked_linear(x, w.blocks, w.out, w.scales, bias);
}

}  // namespace

std::vector<torch::Tensor> project_qkv(torch::Tensor h, torch::Tensor attn_norm, double eps,
                                       BlockedArg wqkv, c10::optional<torch::Tensor> bqkv,
                                       c10::optional<torch::Tensor> q_norm,
                                       c10::optional<torch::Tensor> k_norm, int64_t heads,
                                       int64_t kv_heads, int64_t head_dim, torch::Tensor cos,
                                       torch::Tensor sin) {
  TORCH_CHECK(h.dim() == 2, "h must be (n, hidden)");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q and k norms come together");
  const int64_t n = h.size(0), qs = heads * head_dim, ks = kv_heads * head_dim;
  TORCH_CHECK(wqkv.out == qs + 2 * ks, "the q/k/v product does not match the heads");
  auto qkv = product(rms_norm(h, attn_norm, eps), wqkv, bqkv);
  auto q = qkv.narrow(1, 0, qs).view({n, heads, head_dim});
  auto k = qkv.narrow(1, qs, ks).view({n, kv_heads, head_dim});
  auto v = qkv.narrow(1, qs + ks, ks).view({n, kv_heads, head_dim});
  if (q_norm) {
    q = rms_norm(q, *q_norm, eps);
    k = rms_norm(k, *k_norm, eps);
  }
  return {rope(q, cos, sin), rope(k, cos, sin), v};
}

torch::Tensor post_attention(torch::Tensor attn, torch::Tensor h, BlockedArg wo,
                             c10::optional<torch::Tensor> attn_out_norm, torch::Tensor mlp_norm,
                             BlockedArg w_gate, BlockedArg w_up, BlockedArg w_down,
                             c10::optional<torch::Tensor> mlp_out_norm, int64_t act, double eps) {
  auto out = product(attn, wo, c10::nullopt);
  if (attn_out_norm) out = rms_norm(out, *attn_out_norm, eps);
  auto hx = add_rms_norm(h, out, mlp_norm, eps);
  auto a = gated_act(product(hx[1], w_gate, c10::nullopt), product(hx[1], w_up, c10::nullopt), act);
  out = product(a, w_down, c10::nullopt);
  if (mlp_out_norm) out = rms_norm(out, *mlp_out_norm, eps);
  return hx[0].add_(out);
}
