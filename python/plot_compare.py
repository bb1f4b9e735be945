#!/usr/bin/python3
"""Plots from `laga compare --json` files.

    /usr/bin/python3 python/plot_compare.py out/sweeps out/plots
    /usr/bin/python3 python/plot_compare.py a.json b.json dir/ out/plots

Every argument but the last is a JSON file or a folder searched recursively
for *.json; the last is the folder the PNGs go into (created). It finds, among
the documents, the runs that differ in one quantity only, and draws:

  bytes_vs_p.png      forward and forward+backward bytes sent per rank vs P
  bytes_vs_h.png      forward bytes per rank vs H, and explicit / laga
  memory_vs_s.png     peak activation memory per rank vs S (one panel per
                      attention kernel)
  memory_vs_h.png     peak activation memory per rank vs H
  throughput.png      tokens/s by form (runs that measured time)

A plot is skipped (and said so) when no set of runs varies that quantity;
python/sweep_compare.py makes sets that cover all of them. Bytes are plotted
in MB = 10^6 bytes. Needs matplotlib (Debian's python3-matplotlib); draws
headless (Agg).
"""
import json
import os
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

FORMS = ["explicit", "absorbed", "laga"]
STYLE = {"explicit": dict(color="#1f77b4", marker="o"),
         "absorbed": dict(color="#d62728", marker="s"),
         "laga": dict(color="#2ca02c", marker="^")}


def find_json(paths):
    for p in paths:
        if os.path.isdir(p):
            for root, _, files in os.walk(p):
                for f in sorted(files):
                    if f.endswith(".json"):
                        yield os.path.join(root, f)
        else:
            yield p


def load_docs(paths):
    docs = []
    for path in find_json(paths):
        try:
            with open(path) as f:
                d = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            sys.exit(f"{path}: cannot read it as JSON ({e})")
        if d.get("command") != "compare" or "forms" not in d:
            continue  # a config file or another tool's output
        d["_path"] = path
        docs.append(d)
    return docs


def config_key(d, drop=()):
    c = {k: v for k, v in d["config"].items() if k not in drop}
    return json.dumps(c, sort_keys=True)


def groups(docs, vary, fixed):
    """Sets of runs equal in every `fixed` quantity and differing in `vary`;
    the largest set first."""
    g = defaultdict(dict)
    for d in docs:
        g[tuple(f(d) for f in fixed)][vary(d)] = d
    sets = [s for s in g.values() if len(s) > 1]
    return sorted(sets, key=len, reverse=True)


def form(d, name):
    for f in d["forms"]:
        if f["form"] == name:
            return f
    return None


def series(runs, getter):
    """x -> value per form, over runs keyed by x."""
    out = {}
    for name in FORMS:
        pts = [(x, getter(form(d, name), d)) for x, d in sorted(runs.items()) if form(d, name)]
        pts = [(x, y) for x, y in pts if y is not None]
        if pts:
            out[name] = pts
    return out


def draw(ax, ser, xlabel, ylabel, title, logx=True):
    for name, pts in ser.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name, **STYLE[name])
    if logx:
        ax.set_xscale("log", base=2)
        xs = sorted({p[0] for pts in ser.values() for p in pts})
        ax.set_xticks(xs)
        ax.set_xticklabels([str(x) for x in xs])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend()


def describe(d, skip):
    parts = []
    c = d["config"]
    if "dim" not in skip:
        parts.append(f"D={c['dim']}")
    if "heads" not in skip:
        parts.append(f"H={c['n_heads']}")
    if "seq" not in skip:
        parts.append(f"S={d['seq']}")
    if "sp" not in skip:
        parts.append(f"P={d['sp']}")
    if "attention" not in skip:
        parts.append(d["attention"])
    if d.get("count_only"):
        parts.append("count-only")
    if d.get("rank_only") is not None:
        parts.append(f"rank {d['rank_only']} only")
    return ", ".join(parts)


def save(fig, out, name):
    path = os.path.join(out, name)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    print("wrote", path)


def mb(v):
    return None if v is None else v / 1e6


def paper_count(d, name):
    """Forward bytes as the paper's Table 1 counts them (docs/paper-comparison.md):
    all-to-alls as measured, the latent all-gather as one local shard in bf16."""
    total = 0.0
    for row in form(d, name)["by_label"]:
        if row["phase"] == "forward":
            lat = row["label"] == "latent_ag"
            total += row["bytes_sent"] / (d["sp"] - 1) / 2 if lat else row["bytes_sent"]
    return total


def plot_bytes_vs_p(docs, out):
    sets = groups(docs, lambda d: d["sp"],
                  [lambda d: config_key(d), lambda d: d["seq"], lambda d: d["batch"],
                   lambda d: d["attention"], lambda d: d.get("rank_only") is None])
    if not sets:
        return print("bytes_vs_p.png: skipped, no runs differing only in --sp")
    runs = sets[0]
    any_doc = next(iter(runs.values()))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    draw(axes[0], series(runs, lambda f, d: mb(f["bytes_sent_forward"])), "P (SP ranks)",
         "bytes sent per rank [MB]", "forward, " + describe(any_doc, {"sp"}))
    draw(axes[1], series(runs, lambda f, d: mb(f["bytes_sent_forward"] + f["bytes_sent_backward"])),
         "P (SP ranks)", "bytes sent per rank [MB]", "forward + backward (no grad all-reduce)")
    save(fig, out, "bytes_vs_p.png")


def plot_vs_h(docs, out):
    sets = groups(docs, lambda d: d["config"]["n_heads"],
                  [lambda d: config_key(d, ("n_heads",)), lambda d: d["seq"], lambda d: d["sp"],
                   lambda d: d["batch"], lambda d: d["attention"]])
    if not sets:
        print("bytes_vs_h.png, memory_vs_h.png: skipped, no runs differing only in n_heads")
        return
    runs = sets[0]
    any_doc = next(iter(runs.values()))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    draw(axes[0], series(runs, lambda f, d: mb(f["bytes_sent_forward"])), "H (heads)",
         "forward bytes sent per rank [MB]", describe(any_doc, {"heads"}))
    ratio = []
    for h, d in sorted(runs.items()):
        ex, lg = form(d, "explicit"), form(d, "laga")
        if ex and lg and lg["bytes_sent_forward"]:
            ratio.append((h, ex["bytes_sent_forward"] / lg["bytes_sent_forward"]))
    if ratio:
        axes[1].plot([r[0] for r in ratio], [r[1] for r in ratio], color="black", marker="o",
                     label="explicit / laga, as measured ((P-1) latent shards, fp32)")
        paper = [(h, paper_count(runs[h], "explicit") / paper_count(runs[h], "laga"))
                 for h, _ in ratio]
        axes[1].plot([r[0] for r in paper], [r[1] for r in paper], color="gray", marker="x",
                     linestyle="--", label="under the paper's count (one bf16 latent shard)")
        axes[1].set_xscale("log", base=2)
        axes[1].set_xticks([r[0] for r in ratio])
        axes[1].set_xticklabels([str(r[0]) for r in ratio])
        axes[1].set_xlabel("H (heads)")
        axes[1].set_ylabel("forward bytes ratio")
        axes[1].set_title("communication reduction", fontsize=10)
        axes[1].grid(True, alpha=0.3)
        axes[1].legend()
    save(fig, out, "bytes_vs_h.png")
    fig, ax = plt.subplots(figsize=(6, 4.2))
    draw(ax, series(runs, lambda f, d: mb(f["peak_activation_bytes"])), "H (heads)",
         "peak activation memory per rank [MB]", describe(any_doc, {"heads"}))
    save(fig, out, "memory_vs_h.png")


def plot_memory_vs_s(docs, out):
    by_att = {}
    for att in ["eager", "flash"]:
        sub = [d for d in docs if d["attention"] == att]
        sets = groups(sub, lambda d: d["seq"],
                      [lambda d: config_key(d), lambda d: d["sp"], lambda d: d["batch"]])
        if sets:
            # Up to three P, one line style each; colours stay the forms'.
            by_att[att] = sorted(sets[:3], key=lambda r: next(iter(r.values()))["sp"])
    if not by_att:
        return print("memory_vs_s.png: skipped, no runs differing only in --seq")
    fig, axes = plt.subplots(1, len(by_att), figsize=(5.8 * len(by_att), 4.4), squeeze=False)
    dashes = ["-", "--", ":"]
    for ax, (att, sets) in zip(axes[0], by_att.items()):
        for k, runs in enumerate(sets):
            p = next(iter(runs.values()))["sp"]
            for name, pts in series(runs, lambda f, d: mb(f["peak_activation_bytes"])).items():
                st = dict(STYLE[name])
                ax.plot([q[0] for q in pts], [q[1] for q in pts], linestyle=dashes[k],
                        label=f"{name} P={p}" if len(sets) > 1 else name, **st)
        xs = sorted({s for runs in sets for s in runs})
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs)
        ax.set_xticklabels([str(x) for x in xs])
        ax.set_yscale("log" if len(sets) > 1 else "linear")
        ax.set_xlabel("S (tokens)")
        ax.set_ylabel("peak activation memory per rank [MB]")
        ax.set_title(describe(next(iter(sets[0].values())), {"seq", "sp"} if len(sets) > 1 else {"seq"}),
                     fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7 if len(sets) > 1 else 9)
    save(fig, out, "memory_vs_s.png")


def plot_throughput(docs, out):
    timed = [d for d in docs if any(f.get("tokens_per_s") for f in d["forms"])]
    if not timed:
        return print("throughput.png: skipped, no run measured time (count-only and rank-only "
                     "runs do not)")
    timed.sort(key=lambda d: (d["config"]["dim"], d["seq"], d["sp"]))
    labels = [describe(d, set()) for d in timed]
    fig, ax = plt.subplots(figsize=(max(6, 1.8 * len(timed) + 2), 4.4))
    width = 0.8 / len(FORMS)
    for i, name in enumerate(FORMS):
        xs, ys = [], []
        for k, d in enumerate(timed):
            f = form(d, name)
            if f and f.get("tokens_per_s"):
                xs.append(k + (i - 1) * width)
                ys.append(f["tokens_per_s"])
        ax.bar(xs, ys, width, label=name, color=STYLE[name]["color"])
    ax.set_xticks(range(len(timed)))
    ax.set_xticklabels(labels, rotation=15, ha="right", fontsize=8)
    ax.set_ylabel("tokens/s (forward + backward, slowest rank)")
    ax.set_title("throughput on this machine", fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    ax.set_ylim(top=ax.get_ylim()[1] * 1.15)  # room for the legend above the bars
    ax.legend(ncol=3, loc="upper center")
    save(fig, out, "throughput.png")


def main():
    if len(sys.argv) < 3 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if len(sys.argv) > 1 else 2)
    *inputs, out = sys.argv[1:]
    docs = load_docs(inputs)
    if not docs:
        sys.exit(f"no `laga compare --json` documents found in {', '.join(inputs)}; make them "
                 "with python/sweep_compare.py or laga compare --json FILE")
    os.makedirs(out, exist_ok=True)
    plot_bytes_vs_p(docs, out)
    plot_vs_h(docs, out)
    plot_memory_vs_s(docs, out)
    plot_throughput(docs, out)


if __name__ == "__main__":
    main()
