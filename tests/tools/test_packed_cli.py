#!/ usr / bin / env python3
"""Packed sequences through the `laga` tool (issue 15):

  - `laga forward` with documents (cu_seqlens in --input, shared or one per
    row, int32 or int64; or --doc-lens) writes the same `out` and `dx` as
    `laga forward` on each document alone, concatenated, for every form at
    P 1 and 3;
- `laga verify-- doc - lens` passes;
- `laga train-- data FILE-- pack -
    eos ID` trains,
    logs how many targets each step counts(fewer than B*S), resumes to the same losses,
    and refuses an id outside the vocabulary or absent from the file;
  - bad document lists are refused with exit 2 and one error line naming the
    tensor or the flag.

  test_packed_cli.py LAGA TMPDIR
"""
import json
import os
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
import safetensors_io  # noqa: E402

laga, tmp = sys.argv[1], os.path.join(sys.argv[2], "packed_cli")
os.makedirs(tmp, exist_ok=True)
failures = []
B, S, D = 2, 29, 48  # preset tiny: dim 48
rng = np.random.default_rng(7)
x = rng.standard_normal((B, S, D)).astype(np.float32)
dout = rng.standard_normal((B, S, D)).astype(np.float32)
rows = [[0, 1, 12, 29], [0, 28, 29]]  # a one-token document, and S-1 + 1


def run(args):
    return subprocess.run([laga] + args, capture_output=True, text=True, timeout=300)


def forward(inputs, name, extra):
    path_in = os.path.join(tmp, name + "_in.st")
    path_out = os.path.join(tmp, name + "_out.st")
    safetensors_io.save_file(inputs, path_in)
    r = run(["forward", "--preset", "tiny", "--backward", "--input", path_in, "--output",
             path_out] + extra)
    if r.returncode != 0:
        failures.append(f"forward {name} {extra}: rc {r.returncode}: {r.stderr.strip()[:400]}")
        return None
    return safetensors_io.load_file(path_out)[0]

#The reference : each document alone, through explicit on one rank.
ref = {"out": np.zeros_like(x), "dx": np.zeros_like(x)}
for b, cu in enumerate(rows):
    for k in range(len(cu) - 1):
        t0, t1 = cu[k], cu[k + 1]
        alone = forward({"x": x[b:b + 1, t0:t1], "dout": dout[b:b + 1, t0:t1]},
                        f"alone_{b}_{k}", ["--form", "explicit"])
        if alone:
            for t in ("out", "dx"):
                ref[t][b, t0:t1] = alone[t][0]

per_row = {f"cu_seqlens.{b}": np.array(cu, dtype=np.int32) for b, cu in enumerate(rows)}
#Every registered form(`laga forms`).
registry = json.loads(run(["forms", "--json", "-"]).stdout)["forms"]
for form in [f["name"] for f in registry]:
    for sp in ("1", "3"):
        got = forward(dict(x=x, dout=dout, **per_row), f"packed_{form}{sp}",
                      ["--form", form, "--sp", sp])
        if not got:
            continue
        for t in ("out", "dx"):
            scale = np.abs(ref[t]).max()
            diff = np.abs(got[t] - ref[t]).max()
            if not diff <= 1e-5 * scale:
                failures.append(f"{form} P={sp} {t}: max |diff| {diff:.3g} > 1e-5 x {scale:.3g}")

#One list shared by every row(int64) and --doc - lens give the same file.
shared = [0, 5, 29]
a = forward({"x": x, "dout": dout, "cu_seqlens": np.array(shared, dtype=np.int64)}, "shared",
            ["--form", "laga", "--sp", "2"])
b = forward({"x": x, "dout": dout}, "doc_lens", ["--form", "laga", "--sp", "2", "--doc-lens",
                                                 "5,24"])
if a and b and not all(np.array_equal(a[t], b[t]) for t in ("out", "dx")):
    failures.append("cu_seqlens [0, 5, 29] and --doc-lens 5,24 differ")

r = run(["verify", "--preset", "tiny", "--seq", "23", "--sp", "1,2,3", "--doc-lens",
         "1,10,12/23"])
if r.returncode != 0 or "all forms agree" not in r.stdout:
    failures.append(f"verify --doc-lens: rc {r.returncode}: {r.stdout[-400:]} {r.stderr[-400:]}")

#compare : packing changes no byte on the wire and the memory model stays
#exact; the attention work falls by the pairs' ratio.
reports = {}
for name, extra in (("plain", []), ("packed", ["--doc-lens", "1,15,48"])):
    out = os.path.join(tmp, f"compare_{name}.json")
    r = run(["compare", "--preset", "tiny", "--seq", "64", "--sp", "3", "--steps", "1",
             "--warmup", "0", "--quiet", "--json", out] + extra)
    if r.returncode != 0:
        failures.append(f"compare {name}: rc {r.returncode}: {r.stderr.strip()[:300]}")
        continue
    with open(out) as f:
        reports[name] = json.load(f)
if len(reports) == 2:
    pairs = {"plain": 64 * 65 / 2, "packed": 1 + 15 * 16 / 2 + 48 * 49 / 2}
    for plain, packed in zip(reports["plain"]["forms"], reports["packed"]["forms"]):
        form = packed["form"]
        for key in ("bytes_sent_forward", "bytes_sent_backward", "bytes_sent_grad_sync"):
            if plain[key] != packed[key]:
                failures.append(f"compare {form}: {key} {packed[key]} packed != {plain[key]}")
        if not packed["bytes_match"] or not packed["memory_match"]:
            failures.append(f"compare {form} packed: bytes or memory differ from the model")
        if packed["max_abs_diff"]["out"] > 1e-5 * packed["max_abs_diff"]["out_scale"]:
            failures.append(f"compare {form} packed: out disagrees with explicit")
#Forms whose ranks attend part of the query rows(laga2d's and
#a2a_p2p 's chunks, allgather_kv' s and the ring forms' own tokens):
#their max over ranks
#depends on where the documents fall, so only the whole - sequence
#forms' is the ratio.
        if form in ("laga2d", "a2a_p2p", "allgather_kv", "ring_kv", "ring_latent"):
            continue
        ratio = packed["attention_flops_forward_max"] / plain["attention_flops_forward_max"]
        if abs(ratio - pairs["packed"] / pairs["plain"]) > 1e-12:
            failures.append(f"compare {form}: attention work ratio {ratio}")
    if reports["packed"]["doc_lens"] != "1,15,48":
        failures.append(f"compare JSON doc_lens: {reports['packed']['doc_lens']}")

#Bad lists : exit 2, one "laga: error:" line naming the flag or the tensor.
xin = os.path.join(tmp, "bad_in.st")
bad_files = {
    "unsorted": ({"cu_seqlens": np.array([0, 20, 10, 29], dtype=np.int64)},
                 "'cu_seqlens'", "strictly increasing"),
    "short": ({"cu_seqlens": np.array([0, 20], dtype=np.int32)}, "'cu_seqlens'", "must end"),
    "float": ({"cu_seqlens": np.array([0.0, 29.0], dtype=np.float32)}, "'cu_seqlens'",
              "I32 or I64"),
    "2d": ({"cu_seqlens": np.array([[0, 29], [0, 29]], dtype=np.int64)}, "'cu_seqlens'",
           "one dimension"),
    "row missing": ({"cu_seqlens.0": np.array([0, 29], dtype=np.int64)}, "'cu_seqlens.1'",
                    "per row"),
}
for what, (extra, name, words) in bad_files.items():
    safetensors_io.save_file(dict(x=x, **extra), xin)
    r = run(["forward", "--preset", "tiny", "--input", xin])
    if r.returncode != 2 or name not in r.stderr or words not in r.stderr:
        failures.append(f"bad cu_seqlens ({what}): rc {r.returncode}: {r.stderr.strip()[:300]}")
bad_flags = {"3,3": "add up to 6, not --seq 29", "0,29": "length 0", "a,b": "not a whole number",
             "29/29/29": "3 rows of documents for a batch of 2"}
for text, words in bad_flags.items():
    r = run(["forward", "--preset", "tiny", "--batch", "2", "--seq", "29", "--doc-lens", text])
    if r.returncode != 2 or "--doc-lens" not in r.stderr or words not in r.stderr:
        failures.append(f"--doc-lens {text}: rc {r.returncode}: {r.stderr.strip()[:300]}")
safetensors_io.save_file({"x": x, "cu_seqlens": np.array([0, 29])}, xin)
r = run(["forward", "--preset", "tiny", "--input", xin, "--doc-lens", "29"])
if r.returncode != 2 or "give them once" not in r.stderr:
    failures.append(f"--doc-lens with cu_seqlens: rc {r.returncode}: {r.stderr.strip()[:300]}")

#Training on packed documents : a token file of documents ending with EOS 0.
ids = []
d = 0
while len(ids) < 3000:
    n = 1 + (7 * d) % 13
    ids += [1 + (d + 3 * i) % 60 for i in range(n - 1)] + [0]
    d += 1
data = os.path.join(tmp, "docs.bin")
np.array(ids, dtype=np.uint16).tofile(data)
TRAIN = ["train", "--d-model", "32", "--heads", "4", "--layers", "1", "--vocab", "64", "--seq",
         "32", "--batch", "2", "--sp", "2", "--data", data, "--quiet"]


def train_log(name, extra):
    log = os.path.join(tmp, name + ".jsonl")
    r = run(TRAIN + ["--log", log] + extra)
    if r.returncode != 0:
        failures.append(f"train {name}: rc {r.returncode}: {r.stderr.strip()[:400]}")
        return []
    with open(log) as f:
        return [json.loads(line) for line in f]


ck = os.path.join(tmp, "train_ck")
subprocess.run(["rm", "-rf", ck], check=True)
straight = train_log("straight", ["--pack-eos", "0", "--steps", "6"])
first = train_log("first", ["--pack-eos", "0", "--steps", "3", "--checkpoint", ck])
resumed = train_log("resumed", ["--pack-eos", "0", "--steps", "6", "--resume", ck])
if straight and first and resumed:
    if [s["loss"] for s in straight] != [s["loss"] for s in first + resumed]:
        failures.append("train --pack-eos: a resumed run's losses differ from a straight run's")
    if not all(0 < s["targets"] < 2 * 32 for s in straight):
        failures.append(f"train --pack-eos: targets {[s['targets'] for s in straight]}")
unpacked = train_log("unpacked", ["--steps", "1"])
if unpacked and unpacked[0]["targets"] != 64:
    failures.append(f"train without --pack-eos counts {unpacked[0]['targets']} targets, not 64")
for eos, words in (("64", "--pack-eos 64 is not a token id of the vocabulary [0, 64)"),
                   ("63", "--pack-eos 63: the id never occurs in --data"),
                   ("-1", "--pack-eos: '-1' is not a whole number >= 0")):
    r = run(TRAIN + ["--pack-eos", eos, "--steps", "1"])
    if r.returncode != 2 or words not in r.stderr:
        failures.append(f"train --pack-eos {eos}: rc {r.returncode}: {r.stderr.strip()[:300]}")

for m in failures:
    print("FAILED:", m)
print(f"{len(failures)} failure(s)")
sys.exit(1 if failures else 0)
