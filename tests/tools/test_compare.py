#!/usr/bin/env python3
"""End-to-end checks of `laga compare`, run by CTest with the built binary.

    test_compare.py LAGA_BINARY SCRATCH_DIR CASE

Cases:
  tiny       every form, real run of all ranks: measured bytes equal the closed
             form, measured peaks equal the memory model, laga agrees with
             explicit, the JSON has the documented keys with integer bytes
  modes      count-only and real, rank-only and full, report the same bytes
             and peaks (rank-only R reports rank R; the full run's max over
             ranks equals the max over R of the rank-only runs)
  default    `laga compare` with no arguments succeeds and matches its models
  errors     bad arguments fail with exit 2 and a message naming the fix
  q_latent   --q-latent: FORM+q-latent right after each form with the query_latent
             trait (laga, laga_fused, laga2d) in one table; a real run
             (q_lora_rank > 0, uneven shards) matches its models and explicit;
             at DeepSeek-V3 scale (--count-only, P 8 and 16) every rank's bytes
             per label and its peak equal the models, the query latent's bytes
             are (P-1) rq per token against the all-to-all's (H - H_r) dqk, and
             the note names the crossover
  laga2d     P > H (tiny's 4 heads at P 8): a real run with --head-groups 2
             matches its models and explicit, every rank attends (min work > 0,
             max/min <= 1.10) where laga leaves ranks idle; at DeepSeek-V3
             (--count-only, P 8) it moves laga's bytes exactly and at P 64,
             --head-groups 16, it matches its models and stays balanced
  invariant  --invariant, every form offering it (the registry's): a real run
             at B 2, S 29, P 4 and its count-only twin match their models label
             for label (the canonical sums' included) and report the same bytes
             and peaks; at DeepSeek-V3 (--count-only, S 4099, P 8, where ranks of
             equal shards cut different pieces) every rank's bytes and its peak
             equal the models
Only the standard library, so any python3 runs it.
"""
import json
import os
import subprocess
import sys


def run(laga, args, expect_rc=0):
    p = subprocess.run([laga, "compare", "--quiet"] + args, capture_output=True, text=True)
    if p.returncode != expect_rc:
        sys.exit(f"laga compare {' '.join(args)}: exit {p.returncode}, wanted {expect_rc}\n"
                 f"stdout:\n{p.stdout}\nstderr:\n{p.stderr}")
    return p


def registry(laga):
    """The forms of this build, in registry order (`laga forms --json -`)."""
    r = subprocess.run([laga, "forms", "--json", "-"], capture_output=True, text=True, check=True)
    return json.loads(r.stdout)["forms"]


def compare_json(laga, scratch, name, args):
    path = os.path.join(scratch, name + ".json")
    run(laga, args + ["--json", path])
    with open(path) as f:
        return json.load(f)


def check(cond, what):
    if not cond:
        sys.exit("FAILED: " + what)


def block_parameters(c):
    """DeepSeek's attention parameter count from the config JSON's dims,
    written out here (not from laga's mla_param_shapes): wq or
    wq_a + q_norm + wq_b, then wkv_a, kv_norm, wkv_b, wo."""
    d, h, rq, kv = c["dim"], c["n_heads"], c["q_lora_rank"], c["kv_lora_rank"]
    dn, dr, dv = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    q = h * (dn + dr) * d if rq == 0 else rq * d + rq + h * (dn + dr) * rq
    return q + (kv + dr) * d + kv + h * (dn + dv) * kv + d * h * dv


def check_models(doc, what):
    for f in doc["forms"]:
        check(f["bytes_match"], f"{what} {f['form']}: measured bytes differ from the closed form")
        check(f["memory_match"], f"{what} {f['form']}: measured peak differs from the memory model")
        check(f["bytes_sent_forward"] == f["predicted_bytes_sent_forward"], what)
        check(f["peak_activation_bytes"] == f["predicted_peak_activation_bytes"], what)


TINY = ["--preset", "tiny", "--batch", "2", "--seq", "23", "--sp", "3", "--steps", "2",
        "--warmup", "1"]


def case_tiny(laga, scratch):
    doc = compare_json(laga, scratch, "tiny", TINY)
    check([f["form"] for f in doc["forms"]] == [f["name"] for f in registry(laga)],
          "form order: the registry's")
    check(doc["values_meaningful"] is True, "a full real run has meaningful values")
    check_models(doc, "tiny")
    keys = ["form", "bytes_sent_forward", "bytes_sent_total", "predicted_bytes_sent_forward",
            "peak_activation_bytes", "predicted_peak_activation_bytes", "tokens_per_s",
            "max_abs_diff", "by_label"]
    for f in doc["forms"]:
        for k in keys:
            check(k in f, f"JSON form object lacks '{k}'")
        for k in ["bytes_sent_forward", "bytes_sent_total", "peak_activation_bytes"]:
            check(isinstance(f[k], int), f"{k} must be an integer number of bytes")
        for row in f["by_label"]:
            check(isinstance(row["bytes_sent"], int) and row["match"], f"by_label {row}")
        check(f["tokens_per_s"] > 0, "tokens/s measured")
        check(f["max_abs_diff"] is not None, "agreement computed when explicit runs")
        # fp32 parameters and their gradients (the pool's count), against a
        # count made here from the config.
        n = block_parameters(doc["config"])
        check(f["parameter_bytes"] == 4 * n, f"{f['form']} parameter_bytes {f['parameter_bytes']}"
              f" != 4 x {n} parameters")
        check(f["gradient_bytes"] == 4 * n, f"{f['form']} gradient_bytes {f['gradient_bytes']}"
              f" != 4 x {n} parameters")
    # Agreement: each other form against explicit at the same P (explicit's own
    # row is explicit against itself, which proves nothing, so it is not
    # checked): out, dx and every gradient, fp32 with other summation orders,
    # within 1e-5 of each quantity's own scale (max |explicit|), and the scale
    # must be non-zero or the bound says nothing.
    by_name = {f["form"]: f for f in doc["forms"]}
    ab, lg = by_name["absorbed"], by_name["laga"]
    # The reference is the registry's one reference row (laga forms --json),
    # which compare runs first.
    ref = [r["name"] for r in registry(laga) if r["traits"]["reference"]]
    check(len(ref) == 1 and doc["forms"][0]["form"] == ref[0],
          f"compare runs {doc['forms'][0]['form']} first; the registry's reference rows: {ref}")
    for f in doc["forms"][1:]:
        d = f["max_abs_diff"]
        for q in ("out", "dx", "grad"):
            check(d[q + "_scale"] > 0, f"{f['form']} {q}: the explicit reference is all zeros")
            check(d[q] <= 1e-5 * d[q + "_scale"],
                  f"{f['form']} {q} differs from explicit by {d[q]} (scale {d[q + '_scale']})")
            # laga2d here has one head group (gcd(4, 3)) and allgather_kv has
            # all heads: each rank runs explicit's per-row arithmetic for its
            # query rows, all heads, so out is explicit's to the bit.
            check(d[q] > 0 or f["form"] == "laga" or
                  (f["form"] in ("laga2d", "allgather_kv") and q == "out"),
                  f"{f['form']} {q}: exactly 0 difference from explicit is suspicious for a form "
                  "with another summation order")
    # The wire: laga and absorbed move the same bytes, fewer than explicit
    # once H (dqk + dv) > C + dr... tiny: H=4, dqk=12, dv=6 vs W=28 over
    # (P-1) shards; just require laga == absorbed here.
    check(lg["bytes_sent_total"] == ab["bytes_sent_total"], "laga and absorbed send the same")
    # CSV: header + one row per form.
    csv = os.path.join(scratch, "tiny.csv")
    run(laga, TINY + ["--csv", csv])
    with open(csv) as f:
        rows = f.read().strip().split("\n")
    check(len(rows) == 1 + len(doc["forms"]) and rows[0].startswith("form,"),
          "CSV has a header and a row per form")


def case_modes(laga, scratch):
    base = ["--preset", "tiny", "--seq", "20", "--sp", "4", "--steps", "1", "--warmup", "0"]
    for att in ["eager", "flash"]:
        args = base + ["--attention", att]
        full = compare_json(laga, scratch, "full", args)
        counted = compare_json(laga, scratch, "full_count", args + ["--count-only"])
        check(counted["values_meaningful"] is False, "count-only says values are not meaningful")
        check_models(full, "full")
        check_models(counted, "full count-only")
        per_rank = []
        for r in range(4):
            real = compare_json(laga, scratch, f"r{r}", args + ["--rank-only", str(r)])
            cnt = compare_json(laga, scratch, f"r{r}c", args + ["--rank-only", str(r), "--count-only"])
            check(real["values_meaningful"] is False, "rank-only says values are not meaningful")
            check(real["measured_ranks"] == [r], "rank-only measures its rank")
            check_models(real, f"rank-only {r}")
            check_models(cnt, f"rank-only count-only {r}")
            for a, b in zip(real["forms"], cnt["forms"]):
                for k in ["peak_activation_bytes", "bytes_sent_total", "bytes_sent_forward",
                          "peak_grad_sync_bytes", "peak_comm_buffer_bytes"]:
                    check(a[k] == b[k], f"rank {r} {a['form']} {k}: real {a[k]} count-only {b[k]}")
            per_rank.append(real)
        for i, f in enumerate(full["forms"]):
            c = counted["forms"][i]
            for k in ["peak_activation_bytes", "bytes_sent_total", "bytes_sent_forward",
                      "peak_activations_only_bytes", "peak_grad_sync_bytes"]:
                check(f[k] == c[k], f"{f['form']} {k}: full real {f[k]} vs count-only {c[k]}")
                best = max(p["forms"][i][k] for p in per_rank)
                check(f[k] == best, f"{f['form']} {k}: full {f[k]} vs max over rank-only {best}")


def case_default(laga, scratch):
    p = run(laga, [])
    check("explicit" in p.stdout and "tokens/s" in p.stdout, "the default prints its table")
    check(p.stdout.count(" exact") >= 6, "the default's bytes and memory match their models")


def case_errors(laga, scratch):
    for args, needle in [
        (["--sp", "4", "--rank-only", "4"], "ranks are 0 .. 3"),
        (["--forms", "laga,laga"], "twice"),
        (["--forms", "laga,nope"], "choose one of explicit, absorbed, laga"),
        (["--seq", "2", "--sp", "4"], "shorter than --sp"),
        (["--steps", "0"], "--steps"),
    ]:
        p = run(laga, ["--preset", "tiny"] + args, expect_rc=2)
        check(needle in p.stderr, f"{args}: error should mention '{needle}', got: {p.stderr}")


def by_label(form, phase, label):
    rows = [r for r in form["by_label"] if r["phase"] == phase and r["label"] == label]
    check(len(rows) == 1, f"{form['form']}: one {phase}/{label} row, got {rows}")
    return rows[0]


def case_q_latent(laga, scratch):
    cfg = os.path.join(scratch, "rq.json")
    with open(cfg, "w") as f:
        f.write('{"dim": 48, "n_heads": 5, "q_lora_rank": 20, "kv_lora_rank": 24,'
                ' "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6}')
    doc = compare_json(laga, scratch, "real", ["--config", cfg, "--batch", "2", "--seq", "23",
                                               "--sp", "3", "--steps", "1", "--warmup", "0",
                                               "--q-latent"])
    want = []
    for f in registry(laga):
        want += [f["name"]] + ([f["name"] + "+q-latent"] if f["traits"]["query_latent"] else [])
    check(want[:8] == ["explicit", "absorbed", "laga", "laga+q-latent", "laga_fused",
                       "laga_fused+q-latent", "laga2d", "laga2d+q-latent"],
          f"the registry's forms and traits: {want}")
    check([f["form"] for f in doc["forms"]] == want,
          "each form with the query latent right after it (laga+q-latent after laga, ...)")
    check_models(doc, "q-latent real")
    # H 5 at P 3: laga2d's default grid is one head group of three context
    # groups, so its query latent goes to each group's chunks.
    for i in (3, 5, 7):
        d = doc["forms"][i]["max_abs_diff"]
        name = doc["forms"][i]["form"]
        for q in ("out", "dx", "grad"):
            check(0 < d[q + "_scale"] and d[q] <= 1e-5 * d[q + "_scale"],
                  f"{name} {q} differs from explicit by {d[q]} (scale {d[q + '_scale']})")
    check(by_label(doc["forms"][7], "forward", "q_latent_a2a")["bytes_sent"] > 0,
          "laga2d+q-latent sends its query latent to the context groups")
    check(any("--q-latent" in n for n in doc["notes"]), "a note on the query exchange")

    # DeepSeek-V3 as shipped: rq 1536, H 128, dqk 192; S 4096, every rank.
    for sp in (8, 16):
        v3 = compare_json(laga, scratch, f"v3_{sp}", [
            "--preset", "deepseek-v3", "--count-only", "--forms", "explicit,laga", "--q-latent",
            "--seq", "4096", "--sp", str(sp)])
        check_models(v3, f"V3 P {sp}")
        ex, lg, ql = v3["forms"]
        check(ql["form"] == "laga+q-latent", "the variant's name")
        c = v3["config"]
        L, rq, dqk = 4096 // sp, c["q_lora_rank"], c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
        heads_r = c["n_heads"] // sp
        for phase in ("forward", "backward"):
            check(by_label(ql, phase, "q_latent_ag")["bytes_sent"] == (sp - 1) * L * rq * 4,
                  f"P {sp} {phase} q_latent_ag: (P-1) L rq e")
            check(by_label(lg, phase, "q_a2a")["bytes_sent"] ==
                  L * (c["n_heads"] - heads_r) * dqk * 4, f"P {sp} {phase} q_a2a")
        # Everything else laga sends, --q-latent sends too.
        q_diff = by_label(lg, "forward", "q_a2a")["bytes_sent"] - \
            by_label(ql, "forward", "q_latent_ag")["bytes_sent"]
        check(lg["bytes_sent_forward"] - ql["bytes_sent_forward"] == q_diff, f"P {sp} rest")
        note = next(n for n in v3["notes"] if n.startswith("--q-latent"))
        check("for P < 16" in note and "from P = 16 on it stops paying" in note, note)
        if sp == 8:
            check(ql["bytes_sent_forward"] < lg["bytes_sent_forward"], "P 8: the gather pays")
            check("fewer bytes on every rank" in note, note)
        else:  # P rq = H dqk: the two sends are equal
            check(q_diff == 0, "P 16: the crossover, equal bytes")
            check("fewer bytes on 0 of 16 ranks" in note, note)

    # laga2d with one head group at V3, P 8: 16 chunks of 256 tokens; each
    # rank's 512 tokens are attended by two context groups and it attends
    # 512 rows, so its query latent moves 512 rows of rq each way, against
    # 512 rows of all 128 heads for per-head queries.
    g1 = compare_json(laga, scratch, "v3_g1", [
        "--preset", "deepseek-v3", "--count-only", "--forms", "laga,laga2d", "--q-latent",
        "--head-groups", "1", "--seq", "4096", "--sp", "8"])
    check_models(g1, "V3 P 8 laga2d g1")
    names = [f["form"] for f in g1["forms"]]
    check(names == ["laga", "laga+q-latent", "laga2d", "laga2d+q-latent"], f"{names}")
    l2, l2q = g1["forms"][2], g1["forms"][3]
    for phase in ("forward", "backward"):
        check(by_label(l2q, phase, "q_latent_a2a")["bytes_sent"] == 512 * 1536 * 4,
              f"laga2d+q-latent {phase} q_latent_a2a: 512 rows of rq")
        check(by_label(l2, phase, "q_a2a")["bytes_sent"] == 512 * 128 * 192 * 4,
              f"laga2d {phase} q_a2a: 512 rows of 128 heads")
    check(l2q["bytes_sent_forward"] < g1["forms"][1]["bytes_sent_forward"],
          "laga2d+q-latent sends less than laga+q-latent at P 8")
    note = next(n for n in g1["notes"] if n.startswith("laga2d+q-latent"))
    check("while rq < H_g dqk" in note and "here it sends fewer bytes" in note, note)


def case_laga2d(laga, scratch):
    doc = compare_json(laga, scratch, "p8", ["--preset", "tiny", "--batch", "2", "--seq", "64",
                                             "--sp", "8", "--steps", "1", "--warmup", "0",
                                             "--forms", "explicit,laga,laga2d",
                                             "--head-groups", "2"])
    check_models(doc, "laga2d real")
    ex, lg, l2 = doc["forms"]
    check(l2["form"] == "laga2d", "the form's name")
    d = l2["max_abs_diff"]
    for q in ("out", "dx", "grad"):
        check(0 < d[q + "_scale"] and d[q] <= 1e-5 * d[q + "_scale"],
              f"laga2d {q} differs from explicit by {d[q]} (scale {d[q + '_scale']})")
    check(lg["attention_flops_forward_min"] == 0, "laga at P 8 > H 4 leaves ranks idle")
    lo, hi = l2["attention_flops_forward_min"], l2["attention_flops_forward_max"]
    check(0 < lo and hi / lo <= 1.10, f"laga2d balance {hi / lo}")
    note = next(n for n in doc["notes"] if n.startswith("laga2d:"))
    check("2 head groups x 4 context groups" in note, note)

    # DeepSeek-V3: at P 8 the default rule gives Ph = 8 = P, laga's bytes.
    v3 = compare_json(laga, scratch, "v3_8", ["--preset", "deepseek-v3", "--count-only", "--forms",
                                              "laga,laga2d", "--seq", "4096", "--sp", "8"])
    check_models(v3, "V3 P 8")
    lg, l2 = v3["forms"]
    for key in ("bytes_sent_forward", "bytes_sent_backward", "bytes_sent_grad_sync"):
        check(lg[key] == l2[key], f"V3 P 8 laga2d at Ph = P moves laga's {key}")
    v3 = compare_json(laga, scratch, "v3_64", ["--preset", "deepseek-v3", "--count-only",
                                               "--forms", "laga2d", "--head-groups", "16",
                                               "--seq", "4096", "--sp", "64"])
    check_models(v3, "V3 P 64 Ph 16")
    f = v3["forms"][0]
    check(f["attention_flops_forward_max"] / f["attention_flops_forward_min"] <= 1.10,
          "V3 P 64 Ph 16 balance")
    run(laga, ["--preset", "tiny", "--sp", "8", "--seq", "32", "--forms", "laga",
               "--head-groups", "2"], expect_rc=2)


def case_invariant(laga, scratch):
    offering = [r["name"] for r in registry(laga) if r["traits"]["invariant"]]
    check(len(offering) >= 2, f"forms offering --invariant: {offering}")
    base = ["--forms", ",".join(offering), "--invariant", "--steps", "1", "--warmup", "0"]
    tiny = base + ["--preset", "tiny", "--batch", "2", "--seq", "29", "--sp", "4"]
    full = compare_json(laga, scratch, "inv_full", tiny)
    counted = compare_json(laga, scratch, "inv_count", tiny + ["--count-only"])
    check([f["form"] for f in full["forms"]] == offering, "the forms asked for, in order")
    check_models(full, "--invariant")
    check_models(counted, "--invariant --count-only")
    for f, c in zip(full["forms"], counted["forms"]):
        rows = {(r["phase"], r["label"]): r for r in f["by_label"]}
        for label in ["wo_grad", "in_proj_grad", "kv_norm_grad"]:
            r = rows.get(("backward", label))
            check(r is not None and r["bytes_sent"] > 0 and r["match"],
                  f"{f['form']} backward {label}: {r}")
        for r in c["by_label"]:
            m = rows[(r["phase"], r["label"])]
            check(r["bytes_sent"] == m["bytes_sent"] and r["bytes_received"] == m["bytes_received"],
                  f"{f['form']} {r['phase']}/{r['label']}: count-only {r} vs real {m}")
        for k in ["peak_activation_bytes", "bytes_sent_total", "peak_comm_buffer_bytes",
                  "peak_grad_sync_bytes"]:
            check(f[k] == c[k], f"{f['form']} {k}: real {f[k]} vs count-only {c[k]}")
    v3 = compare_json(laga, scratch, "inv_v3", base + [
        "--preset", "deepseek-v3", "--seq", "4099", "--sp", "8", "--count-only"])
    check_models(v3, "--invariant DeepSeek-V3 count-only")
    check(v3["measured_ranks"] == list(range(8)), f"measured ranks {v3['measured_ranks']}")


def main():
    laga, scratch, case = sys.argv[1], sys.argv[2], sys.argv[3]
    scratch = os.path.join(scratch, "compare_" + case)
    os.makedirs(scratch, exist_ok=True)
    {"tiny": case_tiny, "modes": case_modes, "default": case_default,
     "errors": case_errors, "q_latent": case_q_latent, "laga2d": case_laga2d,
     "invariant": case_invariant}[case](laga, scratch)
    print(f"compare {case}: ok")


if __name__ == "__main__":
    main()
