#include "plan/hardware_profile.hpp"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "comm/link_bounds.hpp"
#include "core/error.hpp"
#include "mla/block.hpp"
#include "mla/comm_model.hpp"
#include "plan/builtin_profiles.hpp"

namespace laga {

using nlohmann::json;

const char* to_string(PlanDType t) {
  return t == PlanDType::fp32 ? "fp32" : "bf16";
}

PlanDType parse_plan_dtype(const std::string& s) {
  for (PlanDType t : {PlanDType::fp32, PlanDType::bf16})
    if (s == to_string(t)) return t;
  fail("--dtype: unknown element type '", s, "'; choose bf16 or fp32");
}

std::int64_t element_bytes(PlanDType t) {
  return t == PlanDType::fp32 ? 4 : 2;
}

std::int64_t gradient_bytes(PlanDType t, GradReduce g) {
  // What a run of that precision moves its gradient all-reduce in (and
  // refuses bf16 gradients of an fp32 one).
  return wire_element_bytes(precision_of(t), g, element_bytes(PlanDType::fp32)).gradients;
}

Precision precision_of(PlanDType t) {
  return t == PlanDType::bf16 ? Precision::bf16 : Precision::fp32;
}

double HardwareProfile::peak_flops(PlanDType t) const {
  const std::optional<double>& p =
      t == PlanDType::fp32 ? device.peak_flops_fp32 : device.peak_flops_bf16;
  LAGA_CHECK(p.has_value(), "profile ", source, ": device.peak_flops.", to_string(t),
             " is null (not published for this device); plan with the other --dtype or give a "
             "profile file with the figure");
  return *p;
}

double HardwareProfile::peak_flops_fp8() const {
  LAGA_CHECK(device.peak_flops_fp8.has_value(), "profile ", source,
             ": device.peak_flops.fp8 is not given (not published for this device); plan "
             "without --fp8, or give a profile file with the figure");
  return *device.peak_flops_fp8;
}

namespace {

// Reads one object's fields by name and refuses keys it was not asked for,
// so a misspelt field is an error rather than a silent default.
class Fields {
 public:
  Fields(const json& j, std::string where, const std::string& source)
      : j_(j), where_(std::move(where)), source_(source) {
    LAGA_CHECK(j.is_object(), "profile ", source_, ": ", where_, " must be a JSON object");
  }
  const json& get(const std::string& key) {
    seen_.insert(key);
    LAGA_CHECK(j_.contains(key), "profile ", source_, ": missing field ", path(key));
    return j_.at(key);
  }
  bool has(const std::string& key) const { return j_.contains(key); }
  // A positive finite number (`allow_zero`: >= 0).
  double number(const std::string& key, bool allow_zero = false) {
    const json& v = get(key);
    LAGA_CHECK(v.is_number(), "profile ", source_, ": ", path(key), " must be a number, got ",
               v.dump());
    const double x = v.get<double>();
    LAGA_CHECK(std::isfinite(x) && (allow_zero ? x >= 0 : x > 0), "profile ", source_, ": ",
               path(key), " = ", v.dump(), " must be ", allow_zero ? ">= 0" : "positive",
               " and finite");
    return x;
  }
  // A whole number >= `least` (an extent or a stride).
  std::int64_t whole(const std::string& key, std::int64_t least) {
    const json& v = get(key);
    LAGA_CHECK(v.is_number_integer() && v.get<std::int64_t>() >= least, "profile ", source_, ": ",
               path(key), " = ", v.dump(), " must be a whole number >= ", least);
    return v.get<std::int64_t>();
  }
  bool flag(const std::string& key) {
    const json& v = get(key);
    LAGA_CHECK(v.is_boolean(), "profile ", source_, ": ", path(key), " must be true or false, got ",
               v.dump());
    return v.get<bool>();
  }
  std::optional<double> number_or_null(const std::string& key) {
    if (get(key).is_null()) return std::nullopt;
    return number(key);
  }
  double fraction(const std::string& key) {
    const double x = number(key);
    LAGA_CHECK(x <= 1, "profile ", source_, ": ", path(key), " = ", x,
               " is an achieved fraction of the peak and must be in (0, 1]");
    return x;
  }
  std::string text(const std::string& key) {
    const json& v = get(key);
    LAGA_CHECK(v.is_string(), "profile ", source_, ": ", path(key), " must be a string");
    return v.get<std::string>();
  }
  Fields object(const std::string& key) { return Fields(get(key), path(key), source_); }
  // The objects of an array field, each as Fields named key[i].
  std::vector<Fields> objects(const std::string& key) {
    const json& v = get(key);
    LAGA_CHECK(v.is_array(), "profile ", source_, ": ", path(key), " must be a JSON array");
    std::vector<Fields> out;
    for (size_t i = 0; i < v.size(); ++i)
      out.emplace_back(v[i], path(key) + "[" + std::to_string(i) + "]", source_);
    return out;
  }
  std::string path(const std::string& key) const {
    return where_.empty() ? key : where_ + "." + key;
  }
  const std::string& source() const { return source_; }
  // Every key of the object was asked for.
  void done() const {
    for (const auto& [key, v] : j_.items())
      LAGA_CHECK(seen_.count(key), "profile ", source_, ": unknown field ", path(key),
                 "; the fields are described in docs/planning.md (Profiles)");
  }

 private:
  const json& j_;
  std::string where_;
  const std::string& source_;
  std::set<std::string> seen_;
};

// Every figure a profile gives, with the range some hardware has: below
// the least a plan's times are inf or NaN, or meaningless (issue 26); past
// the most the times shrink toward 0 and a plan names a winner of steps no
// machine takes (1e308 FLOP/s planned 5e-303 s steps, issue 54). The most
// is tens of times the largest figure any device or link has today, so a
// real profile of the next generations still fits; the least is far below
// any. In one place, with why:
//   peak FLOP/s          [1e6, 1e17]   B200: 2.3e15 dense bf16; a 1 MFLOP/s
//                                      device plans nothing useful
//   memory bytes         [1e6, 1e14]   a GPU holds 2.9e11 (B300), a CPU node
//                                      a few 1e13; 1 MB holds no layer
//   memory/elementwise   [1e3, 1e14]   HBM3e: 8e12 bytes/s
//     bytes/s
//   exponentials/s       [1e3, 1e15]   an H100's SFUs: ~4e12/s
//   efficiency           [1e-3, 1]     an achieved fraction of the peak;
//                                      below 0.1% it measures something else
//   link bytes/s         [1e3, 1e15]   NVLink 5: 9e11 bytes/s per GPU
//                                      (comm/link_bounds.hpp, shared with
//                                      --link)
//   link latency us      [0, 1e7]      (comm/link_bounds.hpp)
//   a measured call's    [1e-9, 1e6]   no kernel returns within a
//     seconds                          nanosecond; 1e6 s is 11 days
//   devices_per_node,    [1, 2^20]
//     shared_cores
struct Figure {
  double least, most;
  const char* unit;  // after the value, "" for none
  const char* hint;  // after a figure below the least
};
constexpr Figure kFlops{1e6, 1e17, "FLOP/s", "the figure is FLOP/s, not TFLOP/s"};
constexpr Figure kMemoryBytes{1e6, 1e14, "bytes", "the figure is bytes, not GB"};
constexpr Figure kBytesPerS{kLeastLinkBytesPerS, 1e14, "bytes/s",
                            "the figure is bytes/s, not GB/s"};
constexpr Figure kExpPerS{1e3, 1e15, "exponentials/s", "leave it out where they are not the bound"};
constexpr Figure kEfficiency{1e-3, 1, "", "it is an achieved fraction of the peak"};
constexpr Figure kLinkBytesPerS{kLeastLinkBytesPerS, kMostLinkBytesPerS, "bytes/s",
                                "the figure is bytes/s, not GB/s"};
constexpr Figure kLatencyUs{0, kMostLinkLatencyUs, "us", ""};
constexpr Figure kSeconds{1e-9, 1e6, "s", "the figure is seconds per call"};

// `v` (f's field `key`) within `b`, or an error naming the field and the
// bound: "device.peak_flops.fp32 = 1e+308 FLOP/s is above any device's (at
// most 1e+17 FLOP/s); ...".
double within(const Fields& f, const std::string& key, double v, const Figure& b,
              const char* what) {
  const std::string unit = *b.unit ? cat(" ", b.unit) : std::string();
  LAGA_CHECK(v >= b.least, "profile ", f.source(), ": ", f.path(key), " = ", v, unit,
             " is below any ", what, "'s (at least ", b.least, unit, ")", *b.hint ? "; " : "",
             b.hint);
  LAGA_CHECK(v <= b.most, "profile ", f.source(), ": ", f.path(key), " = ", v, unit,
             " is beyond any ", what, "'s (at most ", b.most, unit,
             "); the bounds of every figure are in docs/planning.md (Profiles)");
  return v;
}

LinkModel read_link(Fields f) {
  LinkModel l;
  l.bytes_per_s = within(f, "bytes_per_s", f.number("bytes_per_s"), kLinkBytesPerS, "link");
  l.latency_s = within(f, "latency_us", f.number("latency_us", true), kLatencyUs, "link") * 1e-6;
  l.topology = parse_topology(f.text("topology"), f.path("topology"));
  f.done();
  return l;
}

json link_json(const LinkModel& l) {
  return {{"bytes_per_s", l.bytes_per_s},
          {"latency_us", l.latency_s * 1e6},
          {"topology", to_string(l.topology)}};
}

const char* to_string(ops::AttentionPass p) {
  return p == ops::AttentionPass::forward ? "forward" : "backward";
}

ops::AttentionPass parse_pass(const std::string& s, const std::string& where) {
  for (ops::AttentionPass p : {ops::AttentionPass::forward, ops::AttentionPass::backward})
    if (s == to_string(p)) return p;
  fail(where, " = '", s, "' must be forward or backward");
}

// A measured call's seconds: positive and finite.
ShapeTimes read_shapes(Fields f, const std::string& source) {
  ShapeTimes t;
  if (f.has("dtype")) {
    const std::string d = f.text("dtype");
    LAGA_CHECK(d == "fp32" || d == "bf16", "profile ", source, ": ", f.path("dtype"), " = '", d,
               "' must be fp32 or bf16 (the element type the shapes were timed in)");
    t.dtype = parse_plan_dtype(d);
  }
  for (Fields g : f.objects("gemm")) {
    ops::GemmCall c;
    c.trans_a = g.flag("trans_a"), c.trans_b = g.flag("trans_b");
    c.m = g.whole("m", 1), c.n = g.whole("n", 1), c.k = g.whole("k", 1);
    c.lda = g.whole("lda", 1), c.ldb = g.whole("ldb", 1), c.ldc = g.whole("ldc", 1);
    c.accumulate = g.flag("accumulate");
    // A shape given twice has two times: which one costs the plan is not for
    // the reader to guess (merged runs keep one on purpose).
    LAGA_CHECK(
        t.gemm.emplace(c, within(g, "seconds", g.number("seconds"), kSeconds, "call")).second,
        "profile ", source, ": ", g.path("seconds"),
        ": this GEMM shape is given twice in measured_shapes.gemm; "
        "keep one time for each shape");
    g.done();
  }
  for (Fields a : f.objects("attention")) {
    ops::AttentionCall c;
    const std::string kernel = a.text("kernel");
    LAGA_CHECK(kernel == "flash" || kernel == "eager", "profile ", source, ": ", a.path("kernel"),
               " = '", kernel, "' must be flash or eager");
    c.kernel = parse_attention(kernel);
    c.pass = parse_pass(a.text("pass"), "profile " + source + ": " + a.path("pass"));
    c.B = a.whole("B", 1), c.Sq = a.whole("Sq", 1), c.Sk = a.whole("Sk", 1);
    c.Hq = a.whole("Hq", 1), c.Hk = a.whole("Hk", 1), c.dqk = a.whole("dqk", 1);
    c.dv = a.whole("dv", 1);
    c.causal = a.flag("causal");
    LAGA_CHECK(
        t.attention.emplace(c, within(a, "seconds", a.number("seconds"), kSeconds, "call")).second,
        "profile ", source, ": ", a.path("seconds"),
        ": this attention shape is given twice in "
        "measured_shapes.attention; keep one time for each shape");
    a.done();
  }
  f.done();
  return t;
}

// One call's shape as measured_shapes names it (the op counters' fields).
json shape_json(const ops::GemmCall& c) {
  return {{"trans_a", c.trans_a},
          {"trans_b", c.trans_b},
          {"m", c.m},
          {"n", c.n},
          {"k", c.k},
          {"lda", c.lda},
          {"ldb", c.ldb},
          {"ldc", c.ldc},
          {"accumulate", c.accumulate}};
}
json shape_json(const ops::AttentionCall& c) {
  return {{"kernel", to_string(c.kernel)},
          {"pass", to_string(c.pass)},
          {"B", c.B},
          {"Sq", c.Sq},
          {"Sk", c.Sk},
          {"Hq", c.Hq},
          {"Hk", c.Hk},
          {"dqk", c.dqk},
          {"dv", c.dv},
          {"causal", c.causal}};
}

// j with more's fields added.
json with(json j, const json& more) {
  j.update(more);
  return j;
}

json shapes_json(const ShapeTimes& t) {
  json gemm = json::array(), attention = json::array();
  for (const auto& [c, s] : t.gemm) gemm.push_back(with(shape_json(c), {{"seconds", s}}));
  for (const auto& [c, s] : t.attention) attention.push_back(with(shape_json(c), {{"seconds", s}}));
  return {{"dtype", to_string(t.dtype)}, {"gemm", gemm}, {"attention", attention}};
}

}  // namespace

HardwareProfile parse_profile(const std::string& text, const std::string& source) {
  // A key given twice is refused, as configs, safetensors headers and
  // checkpoint manifests refuse it (readers disagree on which wins).
  const json j = parse_json_refusing_repeated_keys(text, "profile " + source);
  HardwareProfile p;
  p.source = source;
  Fields top(j, "", source);
  p.name = top.text("name");
  p.description = top.text("description");
  {
    Fields d = top.object("device");
    Fields peak = d.object("peak_flops");
    p.device.peak_flops_fp32 = peak.number_or_null("fp32");
    p.device.peak_flops_bf16 = peak.number_or_null("bf16");
    // fp8 (dense, the tensor cores' e4m3/e5m2 GEMMs) is optional: only
    // `laga plan --model --fp8` reads it.
    if (peak.has("fp8")) p.device.peak_flops_fp8 = peak.number_or_null("fp8");
    for (const auto& [name, v] :
         {std::pair{"fp32", p.device.peak_flops_fp32}, std::pair{"bf16", p.device.peak_flops_bf16},
          std::pair{"fp8", p.device.peak_flops_fp8}})
      if (v) within(peak, name, *v, kFlops, "device");
    peak.done();
    LAGA_CHECK(p.device.peak_flops_fp32 || p.device.peak_flops_bf16, "profile ", source,
               ": device.peak_flops has neither fp32 nor bf16; give at least one");
    Fields eff = d.object("efficiency");
    p.device.gemm_efficiency = within(eff, "gemm", eff.fraction("gemm"), kEfficiency, "device");
    p.device.attention_efficiency =
        within(eff, "attention", eff.fraction("attention"), kEfficiency, "device");
    eff.done();
    p.device.memory_bytes =
        within(d, "memory_bytes", d.number("memory_bytes"), kMemoryBytes, "device");
    p.device.memory_bytes_per_s =
        within(d, "memory_bytes_per_s", d.number("memory_bytes_per_s"), kBytesPerS, "device");
    p.device.elementwise_bytes_per_s =
        d.has("elementwise_bytes_per_s")
            ? within(d, "elementwise_bytes_per_s", d.number("elementwise_bytes_per_s"), kBytesPerS,
                     "device")
            : p.device.memory_bytes_per_s;
    if (d.has("exp_per_s"))
      p.device.exp_per_s = within(d, "exp_per_s", d.number("exp_per_s"), kExpPerS, "device");
    d.done();
  }
  const double per_node = top.number("devices_per_node");
  LAGA_CHECK(per_node == std::floor(per_node) && per_node <= 1 << 20, "profile ", source,
             ": devices_per_node = ", per_node, " must be a whole number of devices");
  p.devices_per_node = static_cast<int>(per_node);
  if (top.has("shared_cores")) {
    const double cores = top.number("shared_cores");
    LAGA_CHECK(cores == std::floor(cores) && cores <= 1 << 20, "profile ", source,
               ": shared_cores = ", cores, " must be a whole number of cores");
    p.shared_cores = static_cast<int>(cores);
  }
  p.intra_node = read_link(top.object("intra_node"));
  p.inter_node = read_link(top.object("inter_node"));
  if (top.has("measured_shapes"))
    p.measured_shapes = read_shapes(top.object("measured_shapes"), source);
  top.done();
  return p;
}

std::vector<std::string> builtin_profile_names() {
  std::vector<std::string> names;
  for (const auto& [name, text] : plan_detail::builtin_profiles()) names.push_back(name);
  return names;
}

HardwareProfile load_profile(const std::string& name_or_path) {
  for (const auto& [name, text] : plan_detail::builtin_profiles())
    if (name == name_or_path) return parse_profile(text, "built-in " + name);
  std::string names;
  for (const std::string& n : builtin_profile_names()) names += (names.empty() ? "" : ", ") + n;
  LAGA_CHECK(std::filesystem::is_regular_file(name_or_path), "--profile '", name_or_path,
             "' is neither a built-in profile (", names,
             ", or 'this' to measure this machine) nor a readable file");
  std::ifstream in(name_or_path, std::ios::binary);
  LAGA_CHECK(in.good(), "--profile: cannot read '", name_or_path, "'");
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_profile(ss.str(), name_or_path);
}

std::string profile_json(const HardwareProfile& p) {
  auto peak = [](const std::optional<double>& v) { return v ? json(*v) : json(nullptr); };
  json peaks{{"fp32", peak(p.device.peak_flops_fp32)}, {"bf16", peak(p.device.peak_flops_bf16)}};
  if (p.device.peak_flops_fp8) peaks["fp8"] = *p.device.peak_flops_fp8;
  json j = {{"name", p.name},
            {"description", p.description},
            {"device",
             {{"peak_flops", peaks},
              {"efficiency",
               {{"gemm", p.device.gemm_efficiency}, {"attention", p.device.attention_efficiency}}},
              {"elementwise_bytes_per_s", p.device.elementwise_bytes_per_s},
              {"memory_bytes", p.device.memory_bytes},
              {"memory_bytes_per_s", p.device.memory_bytes_per_s}}},
            {"devices_per_node", p.devices_per_node},
            {"intra_node", link_json(p.intra_node)},
            {"inter_node", link_json(p.inter_node)}};
  if (p.device.exp_per_s > 0) j["device"]["exp_per_s"] = p.device.exp_per_s;
  if (p.shared_cores > 0) j["shared_cores"] = p.shared_cores;
  if (!p.measured_shapes.gemm.empty() || !p.measured_shapes.attention.empty())
    j["measured_shapes"] = shapes_json(p.measured_shapes);
  return j.dump(2) + "\n";
}

std::string shape_list_json(const ops::OpCounts& calls) {
  json gemm = json::array(), attention = json::array();
  const auto tally = [](const ops::CallTally& t) {
    return json{{"calls", t.calls}, {"flops", t.flops}};
  };
  for (const auto& [c, t] : calls.gemm_calls) gemm.push_back(with(shape_json(c), tally(t)));
  for (const auto& [c, t] : calls.attention_calls)
    if (c.costed_by_extents()) attention.push_back(with(shape_json(c), tally(t)));
  return json{{"gemm", gemm}, {"attention", attention}}.dump(1) + "\n";
}

}  // namespace laga
