"""`laga forward` on a DSA config (issue 55) under mpirun, through the tool.

For every DSA form the engine runs (`laga forms --json`'s dsa_forms with
runs true: the forms' one registry row, DsaFormTraits), at P 2 (uneven: S 23
= 12 + 11, H 5 = 3 + 2), P 3 with packed documents (1,20,2/23: one crosses
every rank boundary, one is a single token), and laga_recompute at P 4 (a
rank with one head), in float64 with --backward:
  - every rank's rows of out and dx, every gradient (the MLA's and the
    indexer's, grad.indexer.*), the indexer's KL loss and the selection idx
    equal the single-rank explicit DSA run (--form explicit --sp 1) within
    1e-10 relative (idx exactly);
  - each rank's ledger equals its closed form, dsa_predict_comm, label for
    label (the file's ledger metadata: no label differing, bytes equal);
  - the MPI file equals the in-process (--comm local) file byte for byte.
And one dense-warm-up case, and bad input refused under MPI with the same
one message on every rank (--seq-layout zigzag, ring_latent which the
engine does not run). And bf16 (docs/forms.md, "DSA in bf16"): laga_indices
at P 2 under mpirun, and every form at P 3 in-process, against explicit at
P 1 in bf16 within the bf16 bounds (out 20 u, dx, gradients and KL 40 u of
each tensor's largest element, u = 2^-8; mla/ops_bf16.hpp), the same
selection, each rank's ledger its closed form at bf16's wire (bf16
activations, int32 indices and the fp32 KL target at 4 bytes) and the
tool's line saying so, MPI == local byte for byte; and `laga compare` in
bf16 at S 48, P 3, where the selection turns on the indexer's rounding:
every form's selection explicit's at P 1.
usage: dsa_cli_mpi.py LAGA MPIEXEC TMPDIR
"""
import json
import os
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
import safetensors_io  # noqa: E402

laga, mpiexec, tmp = sys.argv[1], sys.argv[2], sys.argv[3]
os.makedirs(tmp, exist_ok=True)
CONFIG = os.path.join(HERE, "tiny_dsa.json")
BASE = ["forward", "--config", CONFIG, "--batch", "2", "--seq", "23", "--backward",
        "--dtype", "float64", "--seed", "3"]
failures = []


def check(ok, what):
    if not ok:
        failures.append(what)
        print("FAIL:", what)


def run(args, P=None, timeout=60):
    cmd = ([mpiexec, "--allow-run-as-root", "--oversubscribe", "-np", str(P), laga] if P
           else [laga]) + args
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def load(path):
    tensors, meta = safetensors_io.load_file(path)
    return tensors, meta


forms = [f["name"] for f in json.loads(run(["forms", "--json", "-"]).stdout)["dsa_forms"]
         if f["runs"]]
check(len(forms) >= 4, f"laga forms lists {len(forms)} DSA forms that run: {forms}")

refs = {}
for stage, docs in (("sparse", []), ("sparse", ["--doc-lens", "1,20,2/23"]),
                    ("dense_warmup", [])):
    key = (stage, bool(docs))
    path = os.path.join(tmp, f"ref_{stage}_{int(bool(docs))}.st")
    r = run(BASE + docs + ["--dsa-stage", stage, "--form", "explicit", "--sp", "1",
                           "--output", path])
    check(r.returncode == 0, f"reference {key}: {r.stderr}")
    refs[key] = load(path)[0]

cases = [(f, P, "sparse", docs) for f in forms
         for P, docs in ((2, []), (3, ["--doc-lens", "1,20,2/23"]))]
cases += [("laga_recompute", 4, "sparse", []), ("laga_indices", 3, "dense_warmup", [])]
for form, P, stage, docs in cases:
    name = f"{form} P {P} {stage}{' packed' if docs else ''}"
    args = BASE + docs + ["--dsa-stage", stage, "--form", form, "--sp", str(P)]
    mpi_path = os.path.join(tmp, f"mpi_{form}_{P}_{stage}.st")
    local_path = os.path.join(tmp, f"local_{form}_{P}_{stage}.st")
    r = run(args + ["--comm", "mpi", "--output", mpi_path], P=P)
    check(r.returncode == 0, f"{name}: mpirun failed: {r.stderr}")
    r2 = run(args + ["--comm", "local", "--output", local_path])
    check(r2.returncode == 0, f"{name}: local failed: {r2.stderr}")
    if r.returncode or r2.returncode:
        continue
    got, meta = load(mpi_path)
    want = refs[(stage, bool(docs))]
    check(set(got) == set(want), f"{name}: tensors {sorted(set(got) ^ set(want))} differ")
    check(any(k.startswith("grad.indexer.") for k in got), f"{name}: no indexer gradient")
    for k in sorted(set(got) & set(want)):
        a, b = np.asarray(got[k]), np.asarray(want[k])
        if k == "idx":
            check(np.array_equal(a, b), f"{name}: the selection differs from explicit's")
            continue
        err = float(np.max(np.abs(a - b))) if a.size else 0.0
        scale = float(np.max(np.abs(b))) if b.size else 0.0
        check(a.shape == b.shape and err <= 1e-10 * max(scale, 1.0),
              f"{name}: {k} max |diff| {err:.3e} against single-rank explicit (scale {scale:.3e})")
    ledger = json.loads(meta["ledger"])
    check(len(ledger) == P, f"{name}: {len(ledger)} ranks' ledgers, not {P}")
    for l in ledger:
        check(l["labels"] > 0 and l["labels_differing"] == 0
              and l["sent"] == l["predicted_sent"] and l["received"] == l["predicted_received"],
              f"{name}: rank {l['rank']}'s ledger is not its closed form: {l}")
    with open(mpi_path, "rb") as a, open(local_path, "rb") as b:
        check(a.read() == b.read(), f"{name}: the MPI and local files differ")
    print(f"ok: {name}: every rank's out, dx, grads, KL, idx = single-rank explicit; "
          f"ledger = dsa_predict_comm; MPI == local")

# bf16 mixed precision.
U = 2.0 ** -8
bf_failures = len(failures)
bf = ["forward", "--config", CONFIG, "--batch", "2", "--seq", "23", "--backward", "--dtype",
      "bf16", "--seed", "3"]
ref_bf = os.path.join(tmp, "ref_bf16.st")
r = run(bf + ["--form", "explicit", "--sp", "1", "--output", ref_bf])
check(r.returncode == 0, f"bf16 reference: {r.stderr}")
paths = [os.path.join(tmp, f"{c}_bf16.st") for c in ("mpi", "local")]
r1 = run(bf + ["--form", "laga_indices", "--sp", "2", "--comm", "mpi", "--output", paths[0]], P=2)
r2 = run(bf + ["--form", "laga_indices", "--sp", "2", "--output", paths[1]])
check(r1.returncode == 0 and r2.returncode == 0, f"bf16 laga_indices: {r1.stderr} {r2.stderr}")
bf_runs = [("laga_indices P 2 (mpirun)", 2, paths[0], r1)]
for f in forms:
    path = os.path.join(tmp, f"local_{f}_3_bf16.st")
    rf = run(bf + ["--form", f, "--sp", "3", "--output", path])
    check(rf.returncode == 0, f"bf16 {f} P 3: {rf.stderr}")
    bf_runs.append((f"{f} P 3", 3, path, rf))
if r.returncode == 0:
    want = load(ref_bf)[0]
    for name, P, path, rf in bf_runs:
        if rf.returncode:
            continue
        got, meta = load(path)
        for k in sorted(want):
            a, b = np.asarray(got[k]), np.asarray(want[k])
            if k == "idx":
                check(np.array_equal(a, b), f"bf16 {name}: the selection differs from explicit's")
                continue
            bound = (20 if k == "out" else 40) * U * max(float(np.max(np.abs(b))), 1e-30)
            check(float(np.max(np.abs(a - b))) <= bound, f"bf16 {name}: {k} past its bound")
        ledger = json.loads(meta["ledger"])
        check(len(ledger) == P and all(
            l["labels"] > 0 and l["labels_differing"] == 0 and l["sent"] == l["predicted_sent"]
            and l["received"] == l["predicted_received"] for l in ledger),
            f"bf16 {name}: a rank's ledger is not its closed form at bf16's wire: {ledger}")
        said = [l for l in rf.stdout.splitlines() if l.startswith("rank ")]
        check(len(said) == P and all("each equal to dsa_predict_comm" in l for l in said),
              f"bf16 {name}: the tool does not say each rank's ledger is exact: {said}")
if r.returncode == 0 and r1.returncode == 0 and r2.returncode == 0:
    with open(paths[0], "rb") as fa, open(paths[1], "rb") as fb:
        check(fa.read() == fb.read(), "bf16: the MPI and local files differ")
if len(failures) == bf_failures:
    print("ok: bf16 laga_indices P 2 (mpirun) and every form at P 3 within the bf16 bounds of "
          "explicit P 1, each rank's ledger = dsa_predict_comm at bf16's wire")

# `laga compare` on the DSA config, in-process (P 3, packed) and under mpirun
# (P 2): a row per DSA form (ring_latent's closed form only), each run form
# agreeing with single-rank explicit DSA within fp32's block tolerance (1e-4
# of the reference's scale), the same selection, its ledger its closed form.
for P, comm, docs in ((3, "local", ["--doc-lens", "5,40,3"]), (2, "mpi", [])):
    args = ["compare", "--config", CONFIG, "--seq", "48", "--sp", str(P), "--comm", comm,
            "--quiet", "--json", "-"] + docs
    r = run(args, P=P if comm == "mpi" else None)
    check(r.returncode == 0, f"compare {comm} P {P}: {r.stderr}")
    if r.returncode:
        continue
    rows = {row["form"]: row for row in json.loads(r.stdout)["dsa_forms"]}
    check(sorted(f for f, row in rows.items() if row["ran"]) == sorted(forms),
          f"compare {comm} P {P}: ran {sorted(rows)}, want {forms}")
    for f in forms:
        row = rows.get(f, {})
        d = row.get("max_abs_diff", {})
        check(row.get("ledger_equals_closed_form") is True and d.get("idx_equal") is True
              and row["sent_per_rank"] == row["predicted_sent_per_rank"] > 0
              and all(d[k] <= 1e-4 * max(1.0, row["reference_max_abs"][k])
                      for k in ("out", "dx", "grads", "kl_loss"))
              and row["memory_peak_closed_form"] > 0,
              f"compare {comm} P {P} {f}: {row}")
    print(f"ok: compare {comm} P {P}: {len(forms)} DSA forms agree, ledgers = closed form")

# bf16, `laga compare` at S 48, P 3, in-process: where scoring from unrounded
# index values and from the values the bf16 wire rounded selects other keys
# (laga_recompute's selection differed from explicit's at P 1 here before
# the indexer's values were rounded where made: docs/forms.md, "DSA in
# bf16"), every form selects as explicit at P 1 in bf16, within the bf16
# bounds (out 20 u, the rest 40 u of the reference's scale), its ledger its
# closed form at bf16's wire.
cmp_failures = len(failures)
r = run(["compare", "--config", CONFIG, "--seq", "48", "--sp", "3", "--dtype", "bf16",
         "--quiet", "--json", "-"])
check(r.returncode == 0, f"compare bf16 P 3: {r.stderr}")
if r.returncode == 0:
    rows = {row["form"]: row for row in json.loads(r.stdout)["dsa_forms"]}
    for f in forms:
        row = rows.get(f, {})
        d = row.get("max_abs_diff", {})
        check(d.get("idx_equal") is True, f"compare bf16 P 3 {f}: the selection differs: {row}")
        check(row.get("ledger_equals_closed_form") is True
              and all(d[k] <= (20 if k == "out" else 40) * U
                      * max(1e-30, row["reference_max_abs"][k])
                      for k in ("out", "dx", "grads", "kl_loss")),
              f"compare bf16 P 3 {f}: {row}")
if len(failures) == cmp_failures:
    print(f"ok: compare bf16 P 3 S 48: {len(forms)} DSA forms select as explicit P 1")

# Given weights and input (--weights, --input): the MLA's and the indexer's
# tensors under DeepSeek's names (the indexer's also under Hugging Face's
# model.layers.0.self_attn. prefix), read and used: laga_indices at P 3
# equals explicit at P 1 on them, and a file whose indexer differs only in
# wk gives another KL; a file without the indexer is refused naming it.
rng = np.random.default_rng(5)
cfg = json.load(open(CONFIG))
D, H, rq, C, dr = cfg["dim"], cfg["n_heads"], cfg["q_lora_rank"], cfg["kv_lora_rank"], \
    cfg["qk_rope_head_dim"]
dn, dv = cfg["qk_nope_head_dim"], cfg["v_head_dim"]
HI, dI = cfg["index_n_heads"], cfg["index_head_dim"]
mla = {"wq_a.weight": (rq, D), "q_norm.weight": (rq,), "wq_b.weight": (H * (dn + dr), rq),
       "wkv_a.weight": (C + dr, D), "kv_norm.weight": (C,), "wkv_b.weight": (H * (dn + dv), C),
       "wo.weight": (D, H * dv)}
indexer = {"wq_b.weight": (HI * dI, rq), "wk.weight": (dI, D), "k_norm.weight": (dI,),
           "k_norm.bias": (dI,), "weights_proj.weight": (HI, D)}
w = {k: (1 + 0.1 * rng.standard_normal(s)) if "norm" in k else 0.2 * rng.standard_normal(s)
     for k, s in mla.items()}
iw = {"indexer." + k: (1 + 0.1 * rng.standard_normal(s)) if "norm" in k
      else 0.3 * rng.standard_normal(s) for k, s in indexer.items()}
files = {"w": {**w, **iw},
         "w_hf": {**w, **{"model.layers.0.self_attn." + k: v for k, v in iw.items()}},
         "w_wk": {**w, **iw, "indexer.wk.weight": -iw["indexer.wk.weight"]},
         "w_none": w}
for name, tensors in files.items():
    safetensors_io.save_file(tensors, os.path.join(tmp, name + ".st"))
safetensors_io.save_file({"x": rng.standard_normal((2, 23, D)),
                          "dout": rng.standard_normal((2, 23, D))}, os.path.join(tmp, "x.st"))
given = {}
for name, form, P in (("w", "explicit", 1), ("w", "laga_indices", 3), ("w_hf", "explicit", 1),
                      ("w_wk", "explicit", 1)):
    out = os.path.join(tmp, f"given_{name}_{form}.st")
    r = run(["forward", "--config", CONFIG, "--weights", os.path.join(tmp, name + ".st"),
             "--input", os.path.join(tmp, "x.st"), "--backward", "--dtype", "float64",
             "--form", form, "--sp", str(P), "--output", out])
    check(r.returncode == 0, f"--weights {name} {form}: {r.stderr}")
    given[(name, form)] = load(out)[0] if r.returncode == 0 else None
if all(v is not None for v in given.values()):
    a, b = given[("w", "explicit")], given[("w", "laga_indices")]
    check(all(np.allclose(a[k], b[k], rtol=1e-10, atol=1e-12) for k in a),
          "given weights: laga_indices P 3 differs from explicit P 1")
    check(all(np.array_equal(a[k], given[("w_hf", "explicit")][k]) for k in a),
          "the indexer under Hugging Face's prefix reads differently from DeepSeek's bare names")
    check(abs(float(a["kl_loss"][0]) - float(given[("w_wk", "explicit")]["kl_loss"][0])) > 1e-6,
          "the indexer's wk from --weights changed nothing: is it read?")
r = run(["forward", "--config", CONFIG, "--weights", os.path.join(tmp, "w_none.st")])
check(r.returncode == 2 and "no tensor 'indexer.wq_b.weight'" in r.stderr,
      f"weights without the indexer: rc {r.returncode}: {r.stderr}")
print("ok: --weights/--input with the indexer: read, used, refused when missing")

# Bad input: one clear error naming the field, the same on every rank.
for extra, said in ((["--seq-layout", "zigzag"], "--seq-layout zigzag"),
                    (["--form", "ring_latent"], "--form ring_latent")):
    args = ["forward", "--config", CONFIG, "--seq", "23", "--sp", "2", "--comm", "mpi"] + extra
    r = run(args, P=2)
    lines = [l for l in r.stderr.splitlines() if "error" in l]
    check(r.returncode != 0 and len(lines) == 2 and len(set(lines)) == 1 and said in lines[0],
          f"{extra}: want one error naming '{said}' from each of 2 ranks, got rc "
          f"{r.returncode}: {r.stderr}")

if failures:
    print(f"{len(failures)} failure(s)")
    sys.exit(1)
print("all DSA cli MPI checks passed")
