// What a form is, for everything that is not the form (docs/architecture.md,
// "Adding a form"). Each form is described once, by the one registry row
// its file src/mla/form_NAME.cpp defines: its name and data flow in a line,
// its traits (the variants it admits), where each rank's attention runs, and
// its closed forms. The block, the variant check, the help texts, `--forms
// all`, the memory, communication and work models, compare's and plan's
// notes and the tests read that row; nothing outside the form's file asks
// which form it is.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/precision.hpp"
#include "mla/config.hpp"
#include "mla/exchange.hpp"
#include "mla/layout.hpp"

namespace laga {

enum class Form {
#define LAGA_FORM(enumerator, entry) enumerator,
#include "mla/forms.def"
#undef LAGA_FORM
};
const char* to_string(Form f);
Form parse_form(const std::string& s);  // a registered name; an unknown one lists them
std::vector<Form> all_forms();          // in registry order (mla/forms.def)
// Every registered name joined by sep ("explicit | absorbed | laga | laga2d"),
// and every form with its data flow, one per line: the help texts.
std::string form_names(const std::string& sep);
std::string form_flows();

enum class AttentionKind { eager, flash };
const char* to_string(AttentionKind a);
AttentionKind parse_attention(const std::string& s);  // "eager" | "flash"
// bf16 mixed precision (ops.hpp, "Precision") runs flash attention only: the
// eager kernel has no bf16 form, and a widened fp32 copy of it would measure
// nothing a bf16 run does. laga::Error naming --attention flash otherwise;
// the CLI asks before it runs, the block asks again where it attends.
void check_precision_supports(Precision p, AttentionKind a);

// How the queries reach the rank that owns their heads (docs/forms.md):
//   heads   q (B, L_r, H dqk) all-to-all seq->head, every form (label q_a2a)
//   latent  the forms with FormTraits::query_latent, q_lora_rank > 0:
//           qn = q_norm(wq_a x) (B, L_r, rq) all-gathered to (B, S, rq)
//           (label q_latent_ag; a form whose ranks attend part of the query
//           rows, laga2d with Pc > 1: sent to those rows (B, Sq, rq),
//           q_latent_a2a), then q_h = qn wq_b[own heads' rows]^T locally.
//           laga sends fewer bytes while P rq < H dqk
//           (query_latent_crossover, comm_model.hpp); laga2d while
//           rq < H_g dqk (query_exchange_cost).
enum class QueryExchange { heads, latent };
const char* to_string(QueryExchange q);
QueryExchange parse_query_exchange(const std::string& s);  // "heads" | "latent"

// Whether a form overlaps its collectives with compute (docs/forms.md,
// "Overlap", `--overlap on|off`), where it has an overlapped path
// (FormTraits::overlap). laga's family: forward starts the latent
// all-gather before the query projection and its all-to-all and waits for
// it only at the up-projection; backward starts the latent gradient's
// reduce-scatter before the query path's backward and waits for it only at
// the latent's. The same collectives, bytes and bits either way; what is
// hidden is the collectives' link time (communicator.hpp, "Overlap").
enum class Overlap { off, on };
const char* to_string(Overlap o);
Overlap parse_overlap(const std::string& s);  // "off" | "on"

// One way to run the block: a form and the choices its traits admit. It is
// the one value every context carries (BlockContext, RunSpec, LmContext,
// TrainOptions), the tools list (`laga verify` and `laga compare` run
// laga+q-latent beside laga) and the closed forms take. A Form alone is that
// form with per-head queries, no overlap and its default head groups.
struct FormVariant {
  Form form = Form::laga;
  QueryExchange queries = QueryExchange::heads;  // latent: FormTraits::query_latent
  int head_groups = 0;  // FormTraits::head_groups: Ph (--head-groups); 0: its default rule
  Overlap overlap = Overlap::off;  // on: FormTraits::overlap
  FormVariant() = default;
  FormVariant(Form f, QueryExchange q = QueryExchange::heads,  // NOLINT: a Form is a variant
              int groups = 0, Overlap o = Overlap::off)
      : form(f), queries(q), head_groups(groups), overlap(o) {}
  friend bool operator==(const FormVariant&, const FormVariant&) = default;
};
std::string to_string(FormVariant v);  // "laga", "laga+q-latent+overlap" (head groups unnamed)

// What a form admits, beyond the plain variant (per-head queries, no
// overlap, no head groups), and what the tools may hold it to.
struct FormTraits {
  bool query_latent = false;  // can move the query latent (QueryExchange::latent, --q-latent)
  bool overlap = false;       // has an overlapped path (Overlap::on, --overlap on)
  bool head_groups = false;   // splits heads x context on a grid (--head-groups)
  // The single-rank reference every other form is held to (explicit):
  // `laga verify` and `laga compare` measure the others' deviation from it.
  bool reference = false;
  // At P 1 on an unpacked batch it runs the reference's arithmetic, so
  // `laga verify` requires bit-identity there, not a tolerance.
  bool exact_at_one_rank = false;
  // Offers the invariant mode (docs/invariance.md, "Which forms"): out, dx
  // and every gradient bit-identical at every P, uneven and packed.
  bool invariant = false;
};

struct CommTerms;   // mla/comm_model.hpp
struct SavedShape;  // mla/memory_model.hpp

// One form's registry row: everything the rest of laga knows of it.
struct FormSpec {
  Form form;
  const char* name;  // --form / --forms
  const char* flow;  // its data flow in one line (help texts, `laga compare --help`)
  FormTraits traits;
  // Where each rank's attention runs (the all-to-alls' destination): the
  // query rows and heads every rank attends. The block's Step, the closed
  // forms and the planner's rank classes read it.
  Placement (*attention)(const SpLayout& layout, FormVariant v);
  // Its rank geometry in words, where the layout alone does not say it
  // (laga2d's grid); null: nothing to add.
  std::string (*geometry)(const SpLayout& layout, FormVariant v);
  // What `laga compare` says of it at this layout; null: nothing.
  std::string (*note)(const MlaConfig& cfg, const SpLayout& layout, FormVariant v);
  // Its closed forms, written from the math and not from its forward, so
  // that the tests that hold the forward to them check something:
  //   its collectives' bytes per (phase, label) (comm_model.hpp),
  void (*collectives)(CommTerms& terms);
  //   the elements it saves for backward beyond what every form saves
  //   (memory_model.hpp, saved_for_backward_elements),
  std::int64_t (*saved_elements)(const SavedShape& shape);
  //   and the widths its attention multiplies per (query, key) pair and
  //   head, q.k's plus p.v's (dqk + dv for head attention): forward FLOPs
  //   are 2 pairs heads width (work_model.hpp).
  std::int64_t (*pair_width)(const MlaConfig& cfg);
};
const FormSpec& form_spec(Form f);  // the row (form.cpp)

// The registered forms with a trait, in registry order, and their names in
// words ("laga and laga2d") for the messages that refuse a variant.
std::vector<Form> forms_with(bool FormTraits::*trait);
std::string names_of_forms_with(bool FormTraits::*trait);
// Any forms' names in words: "allgather_kv, ring_kv and ring_latent"; "no form".
std::string names_of(const std::vector<Form>& forms);

// The one variant check: throws laga::Error naming the option and the form
// when v asks what its form does not admit (FormTraits), when the query
// latent is asked of a config with q_lora_rank 0, or when its head groups do
// not fit the layout (HeadContextGrid::make's rule). Its parts, for callers
// that have no layout yet:
void check_variant(const MlaConfig& cfg, const SpLayout& layout, FormVariant v);
void check_query_exchange(const MlaConfig& cfg, FormVariant v);
void check_overlap(FormVariant v);
void check_head_groups(const SpLayout& layout, FormVariant v);

// Where each rank attends under v: the row's `attention`.
Placement attention_placement(const SpLayout& layout, FormVariant v);
// A run's variant as a header line names it, with its rank geometry where
// the form has one (FormSpec::geometry): "laga2d+q-latent (1 head group x 2
// context groups (heads 16))".
std::string describe_variant(FormVariant v, const SpLayout& layout);

}  // namespace laga
