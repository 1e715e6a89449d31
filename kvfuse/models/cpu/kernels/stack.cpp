// Every layer of a decode step in one call: the runner's per-layer loop of ``forward_batch``
// (project, write the fresh K/V, attend, the rest of the layer) run in C++ when every sequence of
// the step takes the attention kernel and every projection is in blocks.
//
// Why: a decode step of a small model is a few tens of milliseconds, most of it streaming the
// weights; between the layer halves the Python loop pays for four calls per layer (argument
// conversion of every sequence's KV buffer and positions in each, the dispatch, the step's
// bookkeeping), a millisecond or more per step on SmolLM2's 30 layers, and more with 16 sequences
// (two lists of 16 tensors converted twice per layer). The layers are described once per model
// (``Stack``, built by the runner when it loads) and the step once per call; the same functions as
// the step-by-step path run in the same order, so the numbers are those of that path, bit for bit.

#include "kernels.h"

namespace {

torch::Tensor rows_of(const torch::Tensor& x, const c10::optional<torch::Tensor>& rows) {
  return rows ? x.index_select(0, *rows) : x;
}

}  // namespace

void Stack::add_layer(torch::Tensor attn_norm, BlockedArg wqkv, c10::optional<torch::Tensor> bqkv,
                      c10::optional<torch::Tensor> q_norm, c10::optional<torch::Tensor> k_norm,
                      BlockedArg wo, c10::optional<torch::Tensor> attn_out_norm,
                      torch::Tensor mlp_norm, BlockedArg w_gate, BlockedArg w_up, BlockedArg w_down,
                      c10::optional<torch::Tensor> mlp_out_norm, int64_t window,
                      int64_t rope_kind) {
  TORCH_CHECK(rope_kind >= 0, "rope_kind is an index into the step's rotation tables");
  layers.push_back(StackLayer{attn_norm, wqkv, bqkv, q_norm, k_norm, wo, attn_out_norm, mlp_norm,
                              w_gate, w_up, w_down, mlp_out_norm, window, rope_kind});
}

// h: (n, hidden) float32, the step's embedded tokens. kvs/positions/lens: each sequence's KV
// buffer, slot positions and visible length; q_seq/q_pos: each row's sequence and position;
// row0/slot0/count: where each sequence's rows go in its buffer; cos/sin: the step's rotation
// tables per rope kind. At the last layer only `last_rows` (with their sequences and positions) are
// computed, or every row when it is None. Returns the hidden states after the last layer, before
// the final norm.
torch::Tensor run_stack(const Stack& stack, torch::Tensor h, std::vector<torch::Tensor> kvs,
                        std::vector<torch::Tensor> positions, std::vector<int64_t> lens,
                        std::vector<int64_t> q_seq, std::vector<int64_t> q_pos,
                        std::vector<int64_t> row0, std::vector<int64_t> slot0,
                        std::vector<int64_t> count, std::vector<torch::Tensor> cos,
                        std::vector<torch::Tensor> sin, c10::optional<torch::Tensor> last_rows,
                        std::vector<int64_t> last_q_seq, std::vector<int64_t> last_q_pos) {
  TORCH_CHECK(!stack.layers.empty(), "the stack has no layers");
  TORCH_CHECK(cos.size() == sin.size(), "one sin table per cos table");
  const int64_t last = static_cast<int64_t>(stack.layers.size()) - 1;
  for (int64_t i = 0; i <= last; ++i) {
    const StackLayer& l = stack.layers[i];
    TORCH_CHECK(l.rope_kind < static_cast<int64_t>(cos.size()), "no rotation table for layer ", i);
    auto qkv =
        project_qkv(h, l.attn_norm, stack.eps, l.wqkv, l.bqkv, l.q_norm, l.k_norm, stack.heads,
                    stack.kv_heads, stack.head_dim, cos[l.rope_kind], sin[l.rope_kind]);
    write_kv(kvs, i, qkv[1], qkv[2], row0, slot0, count);
    torch::Tensor q = qkv[0];
    const bool narrow = i == last;
    if (narrow) {
      q = rows_of(q, last_rows);
      h = rows_of(h, last_rows);
      if (h.size(0) == 0) return h;
    }
    auto attn = attend(q, kvs, positions, lens, narrow ? last_q_seq : q_seq,
                       narrow ? last_q_pos : q_pos, i, stack.scale, l.window, stack.softcap);
    h = post_attention(attn, h, l.wo, l.attn_out_norm, l.mlp_norm, l.w_gate, l.w_up, l.w_down,
                       l.mlp_out_norm, stack.act, stack.eps);
  }
  return h;
}
