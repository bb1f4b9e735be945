// laga compare: the registered forms (mla/forms.def) on the same weights and
// input — bytes on the wire, peak activation memory, throughput and agreement,
// each measured figure beside its closed-form prediction (docs/compare.md).
// With no options: preset small, S = 1024, P = 4, every form, seconds on two
// cores.
#include <iostream>

#include "core/error.hpp"
#include "tools/commands.hpp"
#include "tools/compare.hpp"
#include "tools/compare_dsa.hpp"
#include "tools/device_option.hpp"
#include "tools/dsa_job.hpp"

namespace laga::tools {

namespace {

void register_compare(CLI::App& app) {
  auto o = std::make_shared<CompareOptions>();
  CLI::App* c = app.add_subcommand(
      "compare",
      cat("Run the forms on the same seeded weights and input and report, per form: bytes sent "
          "per rank (forward, backward, gradient all-reduce, by collective), peak activation "
          "memory per rank, tokens/s, and max |diff| against the reference form; each byte and "
          "memory figure beside its closed-form prediction. On a DSA config (index keys), the "
          "DSA forms: max |diff| against single-rank explicit DSA, bytes beside the closed form, "
          "the memory closed form. The forms:",
          form_flows()));
  o->model.add_to(*c);
  o->model.accepts_dsa = true;  // a DSA config compares the DSA forms (compare_dsa.hpp)
  o->fp8.add_to(*c);
  o->comm.add_to(*c, /*takes_nccl=*/true);
  c->add_option("--batch", o->batch, "sequences per batch (B)")
      ->check(whole_for(1, o->batch))
      ->capture_default_str();
  c->add_option("--seq", o->seq, "sequence length (S), split over the ranks")
      ->check(whole_for(1, o->seq))
      ->capture_default_str();
  c->add_option("--sp", o->sp, "sequence-parallel ranks (P)")
      ->check(whole_for(1, o->sp))
      ->capture_default_str();
  c->add_option("--forms", o->forms,
                cat("comma-separated forms to run (", form_names(", "), "; on a DSA config ",
                    dsa_runnable_form_names(), ", ring_latent's closed forms), or all"))
      ->capture_default_str();
  add_overlap_option(*c, o->overlap, FormsRun::each);
  add_q_latent_flag(*c, o->q_latent, FormsRun::each);
  add_head_groups_option(*c, o->head_groups);
  add_seq_layout_option(*c, o->seq_layout);
  add_attention_option(*c, o->attention);
  add_dtype_option(
      *c,
      [o](RunDtype d) { o->precision = d == RunDtype::bf16 ? Precision::bf16 : Precision::fp32; },
      {RunDtype::fp32, RunDtype::bf16},
      "precision of the runs: fp32, or bf16 mixed precision (every GEMM and attention operand "
      "rounded to bf16, fp32 sums; flash attention only; docs/performance.md, \"bf16 mixed "
      "precision\"). Tensors computed with stay fp32 containers; those kept for backward "
      "are held at 2 bytes where that changes no bit (docs/accounting.md, \"Held at 2 "
      "bytes\"); the activation collectives move bf16 (\"bf16 on the wire\")")
      ->default_str("fp32");
  add_grad_reduce_option(*c, o->grad_reduce);
  c->add_option("--doc-lens", o->doc_lens,
                "packed sequences: document lengths, rows split by / (5,7/12; one list = every "
                "row); attention stays within documents")
      ->check(kDocLensGiven);
  c->add_option("--steps", o->steps, "measured forward+backward steps per form (median reported)")
      ->check(whole_for(1, o->steps))
      ->capture_default_str();
  c->add_option("--warmup", o->warmup, "unmeasured steps per form before them")
      ->check(whole_for(0, o->warmup))
      ->capture_default_str();
  c->add_option("--seed", o->seed, "seed of the weights, input and upstream gradient")
      ->check(whole_for(0, o->seed))
      ->capture_default_str();
  c->add_option("--json", o->json, "write the results as JSON to this file ('-' for stdout)");
  c->add_option("--csv", o->csv, "write one CSV row per form to this file ('-' for stdout)");
  c->add_option("--rank-only", o->rank_only,
                "run only rank R of the --sp group, alone, on a dry-run communicator: exact "
                "bytes and memory for one rank of a job too large for this machine; values are "
                "not numerically meaningful")
      ->check(whole_for(0, o->rank_only));
  c->add_flag("--invariant", o->invariant,
              cat("every form in the invariant mode (", names_of_forms_with(&FormTraits::invariant),
                  "; --attention flash): the same bits at every --sp, at the cost "
                  "docs/invariance.md measures"));
  c->add_flag("--count-only", o->count_only,
              "account every tensor without allocating it and run no kernel: exact bytes and "
              "memory at any size in seconds; no values, no times");
  c->add_option("--link", o->link,
                "shape every collective by the link model: bandwidth BW GB/s (10^9 bytes/s) per "
                "direction and latency LAT microseconds (default 0); each collective completes no "
                "earlier than its alpha-beta time (docs/planning.md). Bytes and results unchanged")
      ->check(link_spec());
  c->add_flag("--quiet", o->quiet, "no progress lines on stderr");
  auto device = std::make_shared<ops::Device>(ops::Device::cpu);
  add_device_option(*c, device);
  c->callback([device, o, c] {
    require_device(*device, "compare", o->comm);
    o->device = *device;
    // The config is an input the outputs may not be, known before the work.
    protect_input(o->model.config_path, "--config");
    // Options given where they would change nothing are refused saying why
    // (issue 54, S): --count-only runs no kernel, so it takes one step of no
    // values and no time whatever --steps, --warmup and --seed say.
    if (o->count_only) {
      // (--steps 1 and --warmup 0 are what it does: accepted.)
      const bool ignored[] = {c->count("--steps") > 0 && o->steps != 1,
                              c->count("--warmup") > 0 && o->warmup != 0, c->count("--seed") > 0};
      const char* const names[] = {"--steps", "--warmup", "--seed"};
      for (int k = 0; k < 3; ++k)
        LAGA_CHECK(!ignored[k], names[k],
                   " shapes the measured runs (their steps, their values), and --count-only runs "
                   "no kernel: it accounts one step's bytes and memory, no values, no times; "
                   "drop ",
                   names[k], " or --count-only");
    }
    vet_outputs({{"--json", o->json}, {"--csv", o->csv}});
    if (run_dsa_compare(*o, [c](const char* name) { return c->count(name) > 0; })) return;
    const std::optional<CompareResult> r = run_compare(*o);
    if (!r) return;  // not the reporting process of an MPI job
    const bool table_to_stdout = o->json != "-" && o->csv != "-";
    (table_to_stdout ? std::cout : std::cerr) << compare_table(*r) << std::flush;
    if (!o->json.empty()) write_output(o->json, compare_json(*r));
    if (!o->csv.empty()) write_output(o->csv, compare_csv(*r));
  });
}

}  // namespace

LAGA_REGISTER_COMMAND(register_compare);

}  // namespace laga::tools
