#!/usr/bin/env python3
"""Run the `laga compare` sweeps that python/plot_compare.py draws and that
docs/paper-comparison.md tabulates, one JSON per run.

    python3 python/sweep_compare.py --laga build/laga --out out/sweeps
    python3 python/sweep_compare.py --out out/sweeps --sweeps p,h     # some only
    python3 python/sweep_compare.py --out out/sweeps --markdown out/paper-tables.md
    /usr/bin/python3 python/plot_compare.py out/sweeps out/plots

Sweeps (folder under --out; every big size is --count-only, seconds each):
  by_p        bytes vs P: preset paper, S = 8192, P = 2, 4, 8, 16
  by_h        bytes and memory vs H: the paper's Fig. 3b dims (D = 2048,
              H = 16..128, other dims V3's), S = 8192, P = 8, eager
  by_s        memory vs S: preset paper, P = 8, S = 4096, 8192, 16384,
              eager and flash
  paper       the paper's Tables 1, 2 and 4 grid: preset paper,
              S = 4096, 8192, 16384 x P = 4, 8, 16, eager and flash
  q_latent    laga --q-latent beside explicit and laga: preset deepseek-v3
              (rq = 1536), S = 4096, P = 8, 16, 64, 256, flash
  throughput  tokens/s, real runs: preset small, S = 1024, P = 1, 2, 4
              (measured on this machine's cores: minutes)
--markdown writes the paper-comparison tables from the JSONs under --out
(run the sweeps first). Every JSON records the command that made it.
Standard library only.
"""
import argparse
import json
import os
import subprocess
import sys

FORMS = ["explicit", "absorbed", "laga"]


def run_compare(laga, args, path, dry):
    cmd = [laga, "compare", "--quiet"] + args + ["--json", path]
    print(" ".join(cmd), flush=True)
    if dry:
        return
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(path) as f:
        doc = json.load(f)
    doc["command_line"] = "laga compare " + " ".join(args)
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)


def paper_config(out, dim, heads):
    """A ModelArgs JSON: DeepSeek-V3 attention dims (rq = 0) with dim/heads set."""
    cfg = {"dim": dim, "n_heads": heads, "q_lora_rank": 0, "kv_lora_rank": 512,
           "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
           "rope_theta": 10000.0, "rope_factor": 40.0, "original_seq_len": 4096,
           "max_seq_len": 163840, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0}
    os.makedirs(os.path.join(out, "configs"), exist_ok=True)
    path = os.path.join(out, "configs", f"d{dim}_h{heads}.json")
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)
    return path


def sweep(name, laga, out, dry):
    d = os.path.join(out, name)
    os.makedirs(d, exist_ok=True)
    co = ["--count-only"]
    if name == "by_p":
        for p in [2, 4, 8, 16]:
            run_compare(laga, ["--preset", "paper", "--seq", "8192", "--sp", str(p)] + co,
                        os.path.join(d, f"paper_s8192_p{p}.json"), dry)
    elif name == "by_h":
        for h in [16, 32, 64, 128]:
            cfg = paper_config(out, 2048, h)
            run_compare(laga, ["--config", cfg, "--seq", "8192", "--sp", "8"] + co,
                        os.path.join(d, f"d2048_h{h}_s8192_p8.json"), dry)
    elif name == "by_s":
        for att in ["eager", "flash"]:
            for s in [4096, 8192, 16384]:
                run_compare(laga, ["--preset", "paper", "--seq", str(s), "--sp", "8",
                                   "--attention", att] + co,
                            os.path.join(d, f"paper_s{s}_p8_{att}.json"), dry)
    elif name == "paper":
        for att in ["eager", "flash"]:
            for p in [4, 8, 16]:
                for s in [4096, 8192, 16384]:
                    run_compare(laga, ["--preset", "paper", "--seq", str(s), "--sp", str(p),
                                       "--attention", att] + co,
                                os.path.join(d, f"paper_s{s}_p{p}_{att}.json"), dry)
    elif name == "q_latent":
        for p in [8, 16, 64, 256]:
            run_compare(laga, ["--preset", "deepseek-v3", "--forms", "explicit,laga", "--q-latent",
                               "--seq", "4096", "--sp", str(p)] + co,
                        os.path.join(d, f"v3_s4096_p{p}.json"), dry)
    elif name == "throughput":
        for p in [1, 2, 4]:
            run_compare(laga, ["--preset", "small", "--seq", "1024", "--sp", str(p),
                               "--steps", "3", "--warmup", "1"],
                        os.path.join(d, f"small_s1024_p{p}.json"), dry)
    else:
        sys.exit(f"unknown sweep '{name}'; choose from by_p, by_h, by_s, paper, q_latent, "
                 "throughput")


# ------------------------------------------------------------------ markdown

def load(path):
    with open(path) as f:
        return json.load(f)


def form(doc, name):
    return next(f for f in doc["forms"] if f["form"] == name)


def paper_convention_fwd(doc, name):
    """The paper's Table 1 count, reproduced: all-to-alls at 4 bytes per element
    times n (P-1)/P, the latent all-gather as ONE local shard at 2 bytes per
    element (bf16), per rank, forward. From our ledger's by_label: a2a bytes
    are ours as is (fp32, (P-1)/P already); latent_ag = (P-1) shards at 4 B,
    so one bf16 shard = ours / (P-1) / 2."""
    f = form(doc, name)
    p = doc["sp"]
    total = 0.0
    for row in f["by_label"]:
        if row["phase"] != "forward":
            continue
        if row["label"] == "latent_ag":
            total += row["bytes_sent"] / (p - 1) / 2
        else:
            total += row["bytes_sent"]
    return total


def label_sent(f, phase, label):
    return next(r["bytes_sent"] for r in f["by_label"] if r["phase"] == phase and r["label"] == label)


def q_latent_table(out, w):
    """laga --q-latent at DeepSeek-V3 dims: bytes and memory per rank against
    explicit and laga, and where the query-latent gather stops paying."""
    rows = [(p, os.path.join(out, "q_latent", f"v3_s4096_p{p}.json")) for p in [8, 16, 64, 256]]
    rows = [(p, load(f)) for p, f in rows if os.path.exists(f)]
    if not rows:
        return
    w("### laga --q-latent — DeepSeek-V3 (rq = 1536), S = 4096, flash, per rank "
      "(MB = 10^6 bytes, max over ranks)\n")
    w("| P | fwd: explicit | fwd: laga | fwd: laga --q-latent | explicit / --q-latent | "
      "fwd+bwd: explicit | laga | --q-latent | query exchange, fwd: q_a2a | q_latent_ag | "
      "peak: explicit | laga | --q-latent |")
    w("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for p, d in rows:
        ex, lg, ql = form(d, "explicit"), form(d, "laga"), form(d, "laga+q-latent")
        mb = lambda b: f"{b / 1e6:.2f}"
        fb = lambda f: f["bytes_sent_forward"] + f["bytes_sent_backward"]
        w(f"| {p} | {mb(ex['bytes_sent_forward'])} | {mb(lg['bytes_sent_forward'])} | "
          f"{mb(ql['bytes_sent_forward'])} | "
          f"{ex['bytes_sent_forward'] / ql['bytes_sent_forward']:.3f}x | {mb(fb(ex))} | "
          f"{mb(fb(lg))} | {mb(fb(ql))} | {mb(label_sent(lg, 'forward', 'q_a2a'))} | "
          f"{mb(label_sent(ql, 'forward', 'q_latent_ag'))} | {mb(ex['peak_activation_bytes'])} | "
          f"{mb(lg['peak_activation_bytes'])} | {mb(ql['peak_activation_bytes'])} |")
    note = next(n for n in rows[0][1]["notes"] if n.startswith("--q-latent"))
    w("")
    w("Crossover (`laga compare --q-latent`'s note): " + note[note.index("With heads"):] + ".")
    w("")


def markdown(out, path):
    lines = []
    w = lines.append
    pdir = os.path.join(out, "paper")
    t1 = {(4, 4096): (251.7, 127.0), (4, 8192): (503.3, 254.0), (8, 4096): (146.8, 74.0),
          (8, 8192): (293.6, 148.0), (8, 16384): (587.2, 296.0), (16, 4096): (78.6, 39.6),
          (16, 8192): (157.3, 79.2), (16, 16384): (314.6, 158.5)}
    w("### Table 1 — forward bytes sent per rank (MB = 10^6 bytes)\n")
    w("| SP | S | paper B1 | paper B2/Laga | laga explicit | laga absorbed | laga laga | "
      "explicit/laga | paper convention: explicit | paper convention: laga | reproduces |")
    w("|---|---|---|---|---|---|---|---|---|---|---|")
    for p in [4, 8, 16]:
        for s in [4096, 8192, 16384]:
            f = os.path.join(pdir, f"paper_s{s}_p{p}_eager.json")
            if not os.path.exists(f):
                continue
            d = load(f)
            ex, ab, lg = (form(d, n)["bytes_sent_forward"] / 1e6 for n in FORMS)
            pe, pl = paper_convention_fwd(d, "explicit") / 1e6, paper_convention_fwd(d, "laga") / 1e6
            pb = t1.get((p, s))
            ok = "—" if pb is None else ("yes" if abs(round(pe, 1) - pb[0]) < 0.051 and
                                         abs(round(pl, 1) - pb[1]) < 0.051 else "NO")
            w(f"| {p} | {s} | {pb[0] if pb else '—'} | {pb[1] if pb else '—'} | {ex:.1f} | "
              f"{ab:.1f} | {lg:.1f} | {ex / lg:.3f}x | {pe:.1f} | {pl:.1f} | {ok} |")
    w("")
    t2 = {(4, 4096): (4620, 5900, 4633), (4, 8192): (14463, 19409, 14485),
          (8, 4096): (2917, 3493, 2929), (8, 8192): (7842, 10207, 7860),
          (8, 16384): (27348, 36596, 27375)}
    for att, title in [("eager", "Table 2 (eager)"), ("flash", "Table 4 fused columns (flash)")]:
        w(f"### {title} — peak activation memory per rank (MB = 10^6 bytes)\n")
        w("| SP | S | paper B1 | paper B2 | paper Laga | laga explicit | laga absorbed | laga laga | "
          "absorbed − explicit | laga vs explicit |")
        w("|---|---|---|---|---|---|---|---|---|---|")
        t4 = {4096: (1796, 3387, 1808), 8192: (2214, 7541, 2231), 16384: (3044, 22281, 3071)}
        for p in [4, 8, 16]:
            for s in [4096, 8192, 16384]:
                f = os.path.join(pdir, f"paper_s{s}_p{p}_{att}.json")
                if not os.path.exists(f):
                    continue
                d = load(f)
                ex, ab, lg = (form(d, n)["peak_activation_bytes"] / 1e6 for n in FORMS)
                pp = t2.get((p, s)) if att == "eager" else (t4.get(s) if p == 8 else None)
                cells = [str(x) for x in pp] if pp else ["—"] * 3
                w(f"| {p} | {s} | {' | '.join(cells)} | {ex:.0f} | {ab:.0f} | {lg:.0f} | "
                  f"{ab - ex:+.0f} | {100 * (lg - ex) / ex:+.2f}% |")
        w("")
    w("### Fig. 3b — the H sweep (S = 8192, SP = 8, D = 2048, eager)\n")
    w("| H | paper fwd ratio | explicit/laga fwd bytes (ours) | paper convention ratio | "
      "paper absorbed inflation (MB) | ours: absorbed − explicit (MB) | laga vs explicit |")
    w("|---|---|---|---|---|---|---|")
    fig = {16: (1.88, 337), 32: (1.94, 657), 64: (1.97, 1269), 128: (1.98, 2512)}
    for h in [16, 32, 64, 128]:
        f = os.path.join(out, "by_h", f"d2048_h{h}_s8192_p8.json")
        if not os.path.exists(f):
            continue
        d = load(f)
        ex, lg = form(d, "explicit"), form(d, "laga")
        ab = form(d, "absorbed")
        ratio = ex["bytes_sent_forward"] / lg["bytes_sent_forward"]
        pr = paper_convention_fwd(d, "explicit") / paper_convention_fwd(d, "laga")
        infl = (ab["peak_activation_bytes"] - ex["peak_activation_bytes"]) / 1e6
        lvse = 100 * (lg["peak_activation_bytes"] - ex["peak_activation_bytes"]) / ex["peak_activation_bytes"]
        w(f"| {h} | {fig[h][0]} | {ratio:.3f} | {pr:.3f} | {fig[h][1]} | {infl:+.0f} | {lvse:+.2f}% |")
    w("")
    q_latent_table(out, w)
    with open(path, "w") as f:
        f.write("\n".join(lines))
    print("wrote", path)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--laga", default="build/laga", help="the laga executable (default build/laga)")
    ap.add_argument("--out", required=True, help="folder for the JSONs (one subfolder per sweep)")
    ap.add_argument("--sweeps", default="by_p,by_h,by_s,paper,q_latent",
                    help="comma-separated: by_p, by_h, by_s, paper, q_latent, throughput "
                         "(default: the count-only ones)")
    ap.add_argument("--markdown", help="write the paper-comparison tables from --out's JSONs here")
    ap.add_argument("--dry", action="store_true", help="print the commands, run nothing")
    a = ap.parse_args()
    if a.markdown:
        markdown(a.out, a.markdown)
        return
    if not a.dry and not os.access(a.laga, os.X_OK):
        sys.exit(f"--laga {a.laga}: not an executable; build it (cmake --build build) or pass its path")
    for name in a.sweeps.split(","):
        sweep(name.strip(), a.laga, a.out, a.dry)


if __name__ == "__main__":
    main()
