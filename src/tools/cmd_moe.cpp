// laga moe: one MoE layer (DeepSeek's, docs/moe.md) on given weights and
// input, forward and optionally backward, its experts folded onto --ep ranks
// (expert parallelism: each rank routes its own token shard and the owners
// run the experts), written to a safetensors file: `out`, the routing
// (`expert_ids` (N, k) best first, `routing_weights` (N, k)), and with
// --backward `dx` and `grad.<name>` under laga's names (gate.weight,
// experts.<e>.w1.weight, ...). What `laga forward` is for the attention
// block: a way to hold another implementation to laga's MoE, or the reverse.
#include <iostream>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.hpp"
#include "core/precision.hpp"
#include "io/safetensors.hpp"
#include "io/safetensors_set.hpp"
#include "mla/config.hpp"
#include "model/moe.hpp"
#include "tools/cli_common.hpp"
#include "tools/commands.hpp"

namespace laga::tools {

namespace {

struct MoeOptions {
  CommOptions comm;
  std::string config, weights, input, output;
  int layer = -1;  // -1: the weights carry laga's bare names
  bool backward = false;
  RunDtype dtype = RunDtype::fp32;
  int ep = 1;
};

// The names a laga MoE parameter may have in a file: laga's and DeepSeek's
// inference code's bare names (gate.weight, experts.3.w1.weight), DeepSeek's
// with their layer prefix (layers.L.ffn.), or Hugging Face's
// (model.layers.L.mlp., w1/w2/w3 as gate_proj/down_proj/up_proj, the bias
// as gate.e_score_correction_bias).
std::string hugging_face_name(const std::string& name) {
  if (name == "gate.bias") return "gate.e_score_correction_bias";
  std::string n = name;
  for (const auto& [ours, theirs] : {std::pair<const char*, const char*>{".w1.", ".gate_proj."},
                                     {".w2.", ".down_proj."},
                                     {".w3.", ".up_proj."}})
    if (const size_t at = n.find(ours); at != std::string::npos)
      n.replace(at, std::string(ours).size(), theirs);
  return n;
}

std::vector<std::string> candidate_names(const std::string& name, int layer) {
  if (layer < 0) return {name};
  const std::string l = std::to_string(layer);
  return {"layers." + l + ".ffn." + name, "model.layers." + l + ".mlp." + hugging_face_name(name)};
}

template <class T>
MoeParams<T> load_moe_weights(const MoeOptions& o, const MoeConfig& cfg, std::int64_t D) {
  MoeParams<T> w = MoeParams<T>::zeros(cfg, D, MemCategory::parameters);
  const SafetensorsSet set = SafetensorsSet::open(o.weights);
  w.for_each(
      [&](const std::string& name, Tensor<T>& t) {
        const std::vector<std::string> names = candidate_names(name, o.layer);
        for (const std::string& n : names)
          if (set.contains(n)) {
            set.read_into(n, t);
            refuse_nonfinite(t, "weights '" + o.weights + "': tensor '" + n + "'",
                             "; fix the file");
            if (name == "gate.bias" && !cfg.gate_has_bias())
              for (std::int64_t e = 0; e < t.numel(); ++e)
                LAGA_CHECK(t[e] == T(0), "weights '", o.weights, "': '", n, "' gives expert ", e,
                           " the bias ", double(t[e]), ", but the config's gate (topk_method '",
                           to_string(cfg.topk_method),
                           "', DeepSeek-V2's) has no bias: it would be ignored; use a noaux_tc "
                           "config, or drop the tensor");
            return;
          }
        // A gate without a bias (V2's) has none in its checkpoint: zero, which
        // route() then holds to (it refuses a non-zero one).
        if (name == "gate.bias" && !cfg.gate_has_bias()) return;
        fail("weights '", o.weights, "' have no tensor ",
             names.size() == 1
                 ? "'" + names[0] + "'"
                 : "'" + names[0] + "' (DeepSeek's name) or '" + names[1] + "' (Hugging Face's)",
             o.layer < 0 ? "; if the file holds a whole model's layers, give --layer L" : "",
             " (the config's MoE: ", cfg.summary(), ")");
      },
      /*with_bias=*/true);
  return w;
}

// The model width D: hidden_size (Hugging Face) or dim (DeepSeek's ModelArgs).
std::int64_t model_width(const nlohmann::json& j, const std::string& source) {
  for (const char* key : {"hidden_size", "dim"})
    if (const auto it = j.find(key); it != j.end()) {
      LAGA_CHECK(it->is_number_integer() && it->get<std::int64_t>() >= 1, source, ": '", key,
                 "' must be a whole number >= 1, got ", it->dump());
      return it->get<std::int64_t>();
    }
  fail(source, ": missing 'hidden_size' (or ModelArgs' 'dim'): the MoE layer's width");
}

template <class T>
Tensor<T> read_rows(const SafetensorsFile& in, const std::string& path, const char* name,
                    std::int64_t D) {
  const Shape s = in.info(name).shape;
  LAGA_CHECK(!s.empty() && s.back() == D && s.size() <= 3, "input '", path, "': '", name,
             "' has shape ", to_string(s), " but the layer needs [N, ", D, "] or [B, S, ", D,
             "] (its last dimension the config's width)");
  Tensor<T> t = in.read<T>(name, MemCategory::activations);
  refuse_nonfinite(t, "input '" + path + "': tensor '" + name + "'", "; fix the file");
  return t;
}

// Each rank's tokens: N / P, the first N % P ranks one more.
std::vector<std::int64_t> token_shards(std::int64_t N, int P) {
  std::vector<std::int64_t> n(static_cast<size_t>(P));
  for (int r = 0; r < P; ++r) n[size_t(r)] = N / P + (r < N % P ? 1 : 0);
  return n;
}

template <class T>
void run_moe(const MoeOptions& o) {
  protect_input(o.config, "--config");
  protect_input(o.input, "--input");
  protect_weights(o.weights, "--weights");
  vet_outputs({{"--output", o.output}});
  const std::string source = "config '" + o.config + "'";
  const nlohmann::json j = read_config_json_file(o.config);
  const std::optional<MoeConfig> parsed = MoeConfig::from_json(j, source);
  LAGA_CHECK(parsed.has_value(), source,
             " has no routed experts (n_routed_experts absent, null or 0): a dense FFN, not an "
             "MoE layer; give the config of an MoE model");
  const MoeConfig cfg = *parsed;
  const std::int64_t D = model_width(j, source);
  const SafetensorsFile in = SafetensorsFile::open(o.input);
  LAGA_CHECK(in.contains("x"), "input '", o.input, "' has no tensor 'x' ([N, ", D, "] tokens)");
  const Tensor<T> x = read_rows<T>(in, o.input, "x", D);
  const std::int64_t N = x.numel() / D;
  LAGA_CHECK(N >= o.ep, "input '", o.input, "': ", N, " tokens, fewer than --ep ", o.ep,
             " (every rank routes at least one); give more tokens or a smaller --ep");
  Tensor<T> dout;
  if (o.backward) {
    LAGA_CHECK(in.contains("dout"),
               "--backward needs 'dout' (the gradient of a loss with respect "
               "to out, x's shape) in input '",
               o.input, "'");
    dout = read_rows<T>(in, o.input, "dout", D);
    LAGA_CHECK(dout.shape() == x.shape(), "input '", o.input, "': 'dout' has shape ",
               to_string(dout.shape()), " but x has ", to_string(x.shape()));
  }
  const MoeParams<T> w = load_moe_weights<T>(o, cfg, D);
  const bool report = is_reporting_process(o.comm);
  if (report)
    std::cerr << "laga moe: " << cfg.summary() << " (scores " << to_string(cfg.scoring_func) << ", "
              << to_string(cfg.topk_method) << "), D=" << D << " N=" << N << ", "
              << to_string(o.dtype) << ", ep " << o.ep << ", comm " << to_string(o.comm.backend)
              << "\n";

  const std::int64_t k = cfg.num_experts_per_tok;
  const std::vector<std::int64_t> n = token_shards(N, o.ep);
  std::vector<std::int64_t> first(size_t(o.ep), 0);
  for (int r = 1; r < o.ep; ++r) first[size_t(r)] = first[size_t(r - 1)] + n[size_t(r - 1)];
  // Gathered on every rank (so under MPI rank 0 holds them): out, dx and the
  // routing by rows; the gradients summed over the ranks (each rank's own
  // tokens' share; an expert's only on its owner).
  Tensor<T> out(x.shape(), MemCategory::activations), dx;
  if (o.backward) dx = Tensor<T>(x.shape(), MemCategory::activations);
  std::vector<T> ids_all(size_t(N * k)), weights_all(size_t(N * k));
  MoeParams<T> grads = MoeParams<T>::zeros(cfg, D, MemCategory::gradients);
  run_group(o.comm, o.ep, [&](Communicator& comm) {
    const int r = comm.rank();
    const ExpertParallel ep = ExpertParallel::folded(comm, cfg.n_routed_experts, n);
    const T* xr = x.data() + first[size_t(r)] * D;
    const std::int64_t nr = n[size_t(r)];
    const MoeForward<T> f = moe_forward(cfg, w, xr, nr, D, o.ep > 1 ? &ep : nullptr);
    std::vector<std::int64_t> rows(size_t(o.ep)), row_first(size_t(o.ep));
    const auto gather = [&](const T* mine, std::int64_t width, T* all, const char* label) {
      for (int q = 0; q < o.ep; ++q)
        rows[size_t(q)] = n[size_t(q)] * width, row_first[size_t(q)] = first[size_t(q)] * width;
      comm.all_gather_v(mine, nr * width, all, rows.data(), row_first.data(), label);
    };
    gather(f.out.data(), D, out.data(), "moe_out");
    std::vector<T> ids(size_t(nr * k));
    for (std::int64_t i = 0; i < nr * k; ++i) ids[size_t(i)] = T(f.saved.routing.expert[size_t(i)]);
    gather(ids.data(), k, ids_all.data(), "moe_expert_ids");
    gather(f.saved.routing.weight.data(), k, weights_all.data(), "moe_routing_weights");
    if (!o.backward) return;
    MoeParams<T> g = MoeParams<T>::zeros(cfg, D, MemCategory::gradients);
    const Tensor<T> dxr = moe_backward(cfg, w, xr, f.saved, dout.data() + first[size_t(r)] * D, g,
                                       o.ep > 1 ? &ep : nullptr);
    gather(dxr.data(), D, dx.data(), "moe_dx");
    // Summed in rank order on every backend (communicator.hpp), so local and
    // MPI runs write the same bits.
    std::vector<Tensor<T>*> into;
    grads.for_each([&](const std::string&, Tensor<T>& t) { into.push_back(&t); }, false);
    size_t i = 0;
    g.for_each(
        [&](const std::string& name, Tensor<T>& t) {
          comm.all_reduce(t.data(), t.numel(), "moe_grad." + name);
          if (r == 0) std::copy(t.data(), t.data() + t.numel(), into[i]->data());
          ++i;
        },
        false);
  });
  if (!report) return;
  for (const auto& [what, t] : {std::pair<const char*, const Tensor<T>*>{"out", &out}, {"dx", &dx}})
    if (t->defined())
      refuse_nonfinite(*t, std::string("output '") + what + "'",
                       " although every input is finite; check the scale of the weights and of "
                       "x, nothing was written");
  std::cout << "out  " << to_string(out.shape()) << "\n";
  if (o.backward) std::cout << "dx   " << to_string(dx.shape()) << "\n";
  if (o.output.empty()) return;
  SafetensorsWriter wr;
  wr.add("out", out);
  Tensor<T> wts({N, k}, MemCategory::activations);
  std::copy(weights_all.begin(), weights_all.end(), wts.data());
  std::vector<std::int64_t> id_values(ids_all.size());
  for (size_t i = 0; i < ids_all.size(); ++i) id_values[i] = std::int64_t(ids_all[i]);
  wr.add_indices("expert_ids", {N, k}, id_values);
  wr.add("routing_weights", wts);
  if (o.backward) {
    wr.add("dx", dx);
    grads.for_each([&](const std::string& name, Tensor<T>& g) { wr.add("grad." + name, g); },
                   false);
  }
  wr.add_metadata("config", cfg.to_json().dump());
  wr.add_metadata("dtype", float_name(o.dtype));
  wr.add_metadata("ep", std::to_string(o.ep));
  wr.write(o.output);
  std::cout << "wrote " << o.output << "\n";
}

void register_moe_command(CLI::App& app) {
  auto opts = std::make_shared<MoeOptions>();
  CLI::App* sub = app.add_subcommand(
      "moe",
      "run one MoE layer (DeepSeek's gate, experts and shared experts) on given weights and "
      "input; write out, the routing (and dx, grads)");
  opts->comm.add_to(*sub);
  sub->add_option("--config", opts->config,
                  "the model's config with its MoE keys: Hugging Face's config.json (V3's "
                  "noaux_tc, V2's greedy or group_limited_greedy) or DeepSeek's ModelArgs JSON")
      ->required()
      ->check(non_empty("--config", "give the path of a config JSON file"));
  sub->add_option("--weights", opts->weights,
                  "the layer's weights: a .safetensors file, a sharded checkpoint's index or "
                  "its directory; laga's names (gate.weight, experts.<e>.w1.weight, ...), or with "
                  "--layer DeepSeek's (layers.L.ffn.*) or Hugging Face's (model.layers.L.mlp.*)")
      ->required()
      ->check(non_empty("--weights", "give the path of a safetensors file"));
  sub->add_option("--layer", opts->layer,
                  "the layer whose MoE to read from a whole model's weights")
      ->check(whole_for(0, opts->layer));
  sub->add_option(
         "--input", opts->input,
         "safetensors with 'x' [N, D] or [B, S, D] (and 'dout', x's shape, for --backward)")
      ->required()
      ->check(non_empty("--input", "give the path of a safetensors file"));
  sub->add_option("--output", opts->output,
                  "safetensors to write 'out', 'expert_ids', 'routing_weights' (and 'dx', "
                  "'grad.<name>')");
  sub->add_flag("--backward", opts->backward, "also run backward, from the input's 'dout'");
  add_dtype_option(
      *sub, [opts](RunDtype d) { opts->dtype = d; },
      {RunDtype::fp32, RunDtype::bf16, RunDtype::fp64},
      "precision of the run: float32, bf16 (mixed precision: every GEMM operand rounded to "
      "bf16, fp32 sums) or float64")
      ->default_str("fp32");
  sub->add_option("--ep", opts->ep,
                  "expert-parallel ranks: the tokens split evenly over them, the experts folded "
                  "onto them (docs/moe.md, \"Expert parallelism\")")
      ->check(whole_for(1, opts->ep))
      ->capture_default_str();
  sub->callback([opts] {
    switch (opts->dtype) {
      case RunDtype::fp64:
        run_moe<double>(*opts);
        return;
      case RunDtype::bf16: {
        const UsePrecision bf16(Precision::bf16);
        run_moe<float>(*opts);
        return;
      }
      case RunDtype::fp32:
        run_moe<float>(*opts);
        return;
    }
  });
}

}  // namespace

LAGA_REGISTER_COMMAND(register_moe_command);

}  // namespace laga::tools
