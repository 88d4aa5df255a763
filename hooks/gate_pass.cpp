// The graph pass behind Overlap::NextForward for scripted models: a
// ddpx::param_ready before every read of a parameter or buffer
// (hooks/param_gate.h). No change to the model's source: the pass edits the
// methods' graphs in place, once per module type (instances of a type share
// their methods, and the op finds each instance's gate by the tensor it
// reads).
#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/api/module.h>
#include <torch/csrc/jit/ir/ir.h>

#include <unordered_set>

#include "hooks/param_gate.h"

namespace ddpx::hooks {

namespace {

using torch::jit::Block;
using torch::jit::Graph;
using torch::jit::Node;

const c10::Symbol& param_ready_symbol() {
  static const c10::Symbol s = c10::Symbol::fromQualString("ddpx::param_ready");
  return s;
}
const c10::Symbol& param_ready_optional_symbol() {  // for Optional[Tensor] attributes
  static const c10::Symbol s = c10::Symbol::fromQualString("ddpx::param_ready_optional");
  return s;
}
bool is_gate(const Node* n) {
  return n->kind() == param_ready_symbol() || n->kind() == param_ready_optional_symbol();
}

// The reads of parameters and buffers in `block` and the blocks nested in it.
void find_reads(Block* block, std::vector<Node*>* out) {
  for (Node* n : block->nodes()) {
    for (Block* b : n->blocks()) find_reads(b, out);
    if (n->kind() != c10::prim::GetAttr) continue;
    const auto cls = n->input(0)->type()->cast<c10::ClassType>();
    // (A conv's bias is an Optional[Tensor] attribute.)
    if (!cls || !n->output()->type()->isSubtypeOf(*c10::OptionalType::ofTensor())) continue;
    const auto slot = cls->findAttributeSlot(n->s(c10::attr::name));
    if (!slot || !(cls->is_parameter(*slot) || cls->is_buffer(*slot))) continue;
    out->push_back(n);
  }
}

int gate_graph(Graph& graph) {
  std::vector<Node*> reads;
  find_reads(graph.block(), &reads);
  int gated = 0;
  for (Node* read : reads) {
    torch::jit::Value* v = read->output();
    const auto& uses = v->uses();
    const bool done = !uses.empty() && std::all_of(uses.begin(), uses.end(), [](const auto& u) {
      return is_gate(u.user);
    });
    if (done || uses.empty()) continue;
    const bool optional = !v->type()->isSubtypeOf(*c10::TensorType::get());
    Node* gate =
        graph.create(optional ? param_ready_optional_symbol() : param_ready_symbol(), {v}, 1);
    gate->insertAfter(read);
    gate->output()->setType(v->type());
    v->replaceAllUsesAfterNodeWith(gate, gate->output());
    ++gated;
  }
  return gated;
}

}  // namespace

int insert_gates(const torch::jit::Module& root) {
  std::unordered_set<const Graph*> seen;
  int gated = 0;
  for (const auto& m : root.modules()) {
    for (const auto& method : m.get_methods()) {
      auto& fn = torch::jit::toGraphFunction(method.function());
      const auto graph = fn.graph();
      if (!seen.insert(graph.get()).second) continue;
      gated += gate_graph(*graph);
      // Inlining callers copy a callee's optimized graph: make it anew.
      fn.clear_optimized_graphs();
    }
  }
  return gated;
}

}  // namespace ddpx::hooks
