#!/usr/bin/env python3
"""`laga plan` end to end.

  test_plan.py LAGA TMPDIR CASE

exact:   every plan's bytes_sent_per_rank and peak_activation_bytes equal
         `laga compare --count-only`'s bytes_sent_total and
         peak_activation_bytes for the same config, P, attention and forms
         (uneven shards included); bf16 is exactly half of fp32.
errors:  bad flags and profiles exit 2 with one "laga: error:" line naming
         what was wrong.
model:   --model: one plan per (S, P, DP, form) with its fields, its parts summing
         to the step, the block it scales equal to the block plan's.
measure: --measure FILE writes a profile that --profile FILE plans with,
         holding the time of every GEMM and attention shape of the plan the
         other options describe: a plan with those options costs every call
         at its measured time, one at another S costs them at the
         efficiency. --list-shapes FILE lists the same shapes, each with its
         calls and FLOPs; timed in bf16 (as scripts/time_shapes_torch.py
         does on a GPU) they cost a bf16 plan's every call and no fp32
         plan's.
"""
import json
import os
import subprocess
import sys

laga, tmp, case = sys.argv[1], sys.argv[2], sys.argv[3]
tmp = os.path.join(tmp, "plan_" + case)
os.makedirs(tmp, exist_ok=True)
failures = []


def run(args, timeout=300):
    return subprocess.run([laga] + args, capture_output=True, text=True, timeout=timeout)


# The forms of this build, in registry order (`laga forms --json -`).
FORMS = [f["name"] for f in json.loads(subprocess.run(
    [laga, "forms", "--json", "-"], capture_output=True, text=True, check=True).stdout)["forms"]]


def load(args, name, ok=(0,)):
    out = os.path.join(tmp, name + ".json")
    r = run(args + ["--json", out])
    if r.returncode not in ok:
        sys.exit(f"FAILED: laga {' '.join(args)} exited {r.returncode}: {r.stderr}")
    with open(out) as f:
        return json.load(f)


PLAN_FIELDS = ["form", "seq", "sp", "bytes_sent_per_rank", "bytes_sent_forward",
               "bytes_sent_backward", "peak_activation_bytes",
               "predicted_step_s", "predicted_tokens_per_s", "comm_fraction", "hidden_comm_s",
               "peer_wait_s", "core_share_s", "critical_rank", "phases", "fits"]
PHASE_SECONDS = ["gemm_s", "attention_s", "elementwise_s", "comm_s"]
PHASE_FIELDS = PHASE_SECONDS + ["gemm_flops", "attention_flops", "unmeasured_flops"]


def check_exact(model, seq, sp, attention, extra, name):
    """plan --dtype fp32 against compare --count-only at one (S, P)."""
    c = load(["compare", "--quiet", "--count-only", "--seq", str(seq), "--sp", str(sp),
              "--attention", attention] + model + extra, name + "_compare")
    p = load(["plan", "--quiet", "--profile", "h100", "--dtype", "fp32", "--seq", str(seq),
              "--sp", str(sp), "--attention", attention] + model + extra, name + "_plan")
    # bf16 with its gradients reduced in bf16: every byte half of fp32's;
    # with the default fp32 gradients, what a `compare --dtype bf16` run
    # moves (activations at 2 bytes, the gradient all-reduce at 4).
    b = load(["plan", "--quiet", "--profile", "h100", "--dtype", "bf16", "--grad-reduce", "bf16",
              "--seq", str(seq), "--sp", str(sp), "--attention", attention] + model + extra,
             name + "_plan_bf16")
    b32 = load(["plan", "--quiet", "--profile", "h100", "--dtype", "bf16", "--seq", str(seq),
                "--sp", str(sp), "--attention", attention] + model + extra,
               name + "_plan_bf16_fp32_grads")
    if b32["grad_reduce"] != "fp32" or b["grad_reduce"] != "bf16":
        failures.append(f"{name}: grad_reduce {b32['grad_reduce']}, {b['grad_reduce']}")
    c16 = None
    if attention == "flash":  # bf16 runs flash attention only
        c16 = load(["compare", "--quiet", "--count-only", "--dtype", "bf16", "--seq", str(seq),
                    "--sp", str(sp), "--attention", attention] + model + extra,
                   name + "_compare_bf16")
        c16 = {f["form"]: f for f in c16["forms"]}
    measured = {f["form"]: f for f in c["forms"]}
    if len(p["plans"]) != len(measured):
        failures.append(f"{name}: {len(p['plans'])} plans for {len(measured)} compared forms")
    for plan, half, fp32_grads in zip(p["plans"], b["plans"], b32["plans"]):
        if list(plan.keys()) != PLAN_FIELDS:
            failures.append(f"{name}: plan fields {list(plan.keys())} != {PLAN_FIELDS}")
        f = measured.get(plan["form"])
        if f is None:
            failures.append(f"{name}: plan for {plan['form']} which compare did not run")
            continue
        if plan["bytes_sent_per_rank"] != f["bytes_sent_total"]:
            failures.append(f"{name} {plan['form']}: bytes {plan['bytes_sent_per_rank']} != "
                            f"compare's {f['bytes_sent_total']}")
        if plan["bytes_sent_forward"] != f["bytes_sent_forward"]:
            failures.append(f"{name} {plan['form']}: forward bytes {plan['bytes_sent_forward']} != "
                            f"compare's {f['bytes_sent_forward']}")
        if plan["peak_activation_bytes"] != f["peak_activation_bytes"]:
            failures.append(f"{name} {plan['form']}: peak {plan['peak_activation_bytes']} != "
                            f"compare's {f['peak_activation_bytes']}")
        if 2 * half["bytes_sent_per_rank"] != plan["bytes_sent_per_rank"] or \
                2 * half["peak_activation_bytes"] != plan["peak_activation_bytes"]:
            failures.append(f"{name} {plan['form']}: bf16 is not half of fp32: {half} / {plan}")
        if c16 is not None and \
                fp32_grads["bytes_sent_per_rank"] != c16[plan["form"]]["bytes_sent_total"]:
            failures.append(f"{name} {plan['form']}: bf16 bytes with fp32 gradients "
                            f"{fp32_grads['bytes_sent_per_rank']} != compare --dtype bf16's "
                            f"{c16[plan['form']]['bytes_sent_total']}")
        if not (plan["predicted_step_s"] > 0 and 0 <= plan["comm_fraction"] <= 1):
            failures.append(f"{name} {plan['form']}: step {plan['predicted_step_s']}, comm "
                            f"fraction {plan['comm_fraction']}")
        # The step is its phases' parts summed, less the communication
        # overlap hid; only +overlap variants hide any.
        phases = plan["phases"]
        if list(phases.keys()) != ["forward", "backward", "grad_sync"] or \
                any(list(v.keys()) != PHASE_FIELDS for v in phases.values()):
            failures.append(f"{name} {plan['form']}: phases {phases}")
            continue
        total = sum(v[k] for v in phases.values() for k in PHASE_SECONDS)
        # FLOPs: the busiest rank's, counted; grad_sync computes none, the
        # attention's backward (recomputation + gradients) more than forward.
        fl = {k: (v["gemm_flops"], v["attention_flops"]) for k, v in phases.items()}
        if fl["grad_sync"] != (0, 0) or not (0 < fl["forward"][1] < fl["backward"][1]) or \
                not (0 < fl["forward"][0] < fl["backward"][0]):
            failures.append(f"{name} {plan['form']}: FLOPs per phase {fl}")
        # ... plus its waits for peers (the critical rank's: none on these
        # profiles, which give every rank a device, so no core sharing).
        step, hidden = plan["predicted_step_s"], plan["hidden_comm_s"]
        waits = plan["peer_wait_s"] + plan["core_share_s"]
        if abs(total - hidden + waits - step) > 1e-9 * step or plan["core_share_s"] != 0:
            failures.append(f"{name} {plan['form']}: phases sum {total} - hidden {hidden} + "
                            f"waits {waits} != step {step}")
        if not 0 <= plan["critical_rank"] < plan["sp"]:
            failures.append(f"{name} {plan['form']}: critical_rank {plan['critical_rank']} of "
                            f"{plan['sp']} ranks")
        if (hidden > 0) != plan["form"].endswith("+overlap"):
            failures.append(f"{name} {plan['form']}: hidden_comm_s {hidden}")


def check_error(args, want, name):
    r = run(args)
    lines = [l for l in r.stderr.splitlines() if l.startswith("laga: error:")]
    if r.returncode != 2 or len(lines) != 1 or want not in lines[0]:
        failures.append(f"{name}: laga {' '.join(args)} exited {r.returncode}, stderr "
                        f"{r.stderr.strip()!r}; want one 'laga: error:' line with {want!r}")


if case == "exact":
    tiny = ["--preset", "tiny"]
    check_exact(tiny, 37, 3, "eager", [], "tiny_uneven_eager")   # S % P != 0, H % P != 0
    check_exact(tiny, 64, 8, "flash", [], "tiny_heads_empty")    # P > H: ranks without heads
    check_exact(["--preset", "small"], 1024, 4, "flash", [], "small")
    check_exact(["--preset", "small"], 1000, 3, "flash", ["--overlap", "both"], "small_overlap")
    # Every variant on layouts where ranks of equal shards do different work
    # (laga2d's context groups: what a rank sends depends on which query
    # chunks its tokens fall in). Issue 29: the plan costed each class's
    # first rank and reported 63,648 for tiny's 68,256 B, 2,421,184 for
    # small's 2,748,864 B and 1.410 GB for DeepSeek-V3's 1.494 GB.
    every = ["--overlap", "both"]
    check_exact(tiny, 96, 6, "flash", every, "tiny_p6_grid")
    check_exact(["--preset", "small"], 1024, 8, "flash", every + ["--head-groups", "2"],
                "small_p8_hg2")
    v3 = ["--preset", "deepseek-v3"]
    v3_every = every + ["--q-latent"]
    check_exact(v3, 4096, 8, "flash", v3_every + ["--head-groups", "1"], "v3_p8_hg1")
    check_exact(v3, 32768, 8, "flash", v3_every, "v3_p8")
    check_exact(v3, 32768, 16, "flash", v3_every + ["--head-groups", "4"], "v3_p16_hg4")
    check_exact(v3, 131072, 64, "flash", v3_every, "v3_p64")
    check_exact(v3, 131072, 64, "flash", v3_every + ["--head-groups", "8"], "v3_p64_hg8")
    # Zigzag shards (--seq-layout zigzag): the same exactness, uneven chunks,
    # P > H, and the sequence-parallel forms' predicted step below
    # contiguous's (their busiest rank's attention halves at P 8).
    zig = ["--seq-layout", "zigzag"]
    check_exact(tiny, 37, 3, "eager", zig, "tiny_uneven_eager_zigzag")
    check_exact(tiny, 64, 8, "flash", zig, "tiny_heads_empty_zigzag")
    check_exact(v3, 32768, 8, "flash", v3_every + zig, "v3_p8_zigzag")
    seq_sp = ["--seq", "32768", "--sp", "8", "--forms", "allgather_kv,ring_kv,ring_latent"]
    both = {lay: load(["plan", "--quiet", "--profile", "h100", "--seq-layout", lay] + v3 + seq_sp,
                      "v3_p8_sp_" + lay) for lay in ("contiguous", "zigzag")}
    if both["zigzag"]["seq_layout"] != "zigzag":
        failures.append(f"plan --seq-layout zigzag: JSON seq_layout {both['zigzag']['seq_layout']}")
    # The table says where the contiguous layout leaves a form unbalanced.
    for lay, want in (("contiguous", True), ("zigzag", False)):
        out = run(["plan", "--quiet", "--profile", "h100", "--seq-layout", lay] + v3 +
                  seq_sp).stdout
        note = "allgather_kv, ring_kv and ring_latent attend their own tokens' queries"
        if (note in out) != want or (want and "--seq-layout zigzag plans them" not in out):
            failures.append(f"plan --seq-layout {lay}: the balance note is "
                            f"{'missing' if want else 'printed'}:\n{out}")
    if "attend their own tokens' queries" in run(["plan", "--quiet", "--profile", "h100"] + v3 +
                                                 ["--seq", "32768", "--sp", "8", "--forms",
                                                  "laga,explicit"]).stdout:
        failures.append("plan of head-parallel forms: the balance note is printed")
    for a, b in zip(both["contiguous"]["plans"], both["zigzag"]["plans"]):
        if not b["predicted_step_s"] < 0.8 * a["predicted_step_s"]:
            failures.append(f"{a['form']} at 32k P 8: zigzag {b['predicted_step_s']} s is not "
                            f"below 0.8x contiguous's {a['predicted_step_s']} s")
    # A sweep: one plan per form, S and P, in that order.
    p = load(["plan", "--quiet", "--profile", "910b", "--preset", "tiny", "--seq", "64,128",
              "--sp", "1,2,4"], "sweep")
    got = [(q["seq"], q["sp"], q["form"]) for q in p["plans"]]
    want = [(s, n, f) for s in (64, 128) for n in (1, 2, 4) for f in FORMS]
    if got != want:
        failures.append(f"sweep order {got} != {want}")
    if len(p["cases"]) != 6 or any(c["winner"] is None for c in p["cases"]):
        failures.append(f"sweep cases: {p['cases']}")
    # A ring form wins where its bytes decide: DeepSeek-V3, 32k, P 64 on
    # 8 nodes with every link at 1 GB/s, where the latent ring sends 0.11 GB
    # per rank against laga's 0.63 (docs/paper-comparison.md, section 9);
    # at the profile's own links laga wins again.
    ring = ["plan", "--quiet", "--profile", "h100", "--preset", "deepseek-v3", "--seq", "32768",
            "--sp", "64", "--overlap", "on", "--forms", "explicit,laga,ring_kv,ring_latent"]
    for link, want in (("1", "ring_latent+overlap"), (None, "laga+overlap")):
        p = load(ring + (["--link", link] if link else []), f"ring_winner_{link}")
        if p["cases"][0]["winner"] != want:
            failures.append(f"ring winner at --link {link}: {p['cases'][0]['winner']}, want {want}")
elif case == "errors":
    base = ["plan", "--preset", "tiny", "--seq", "64", "--sp", "2"]
    check_error(base, "laga plan needs --profile NAME|FILE", "no profile")
    listed = os.path.join(tmp, "listed.json")
    check_error(base + ["--list-shapes", listed, "--profile", "h100"],
                "--list-shapes FILE lists the plan's GEMM and attention shapes and plans nothing, "
                "so --profile would be ignored", "list-shapes with a profile")
    check_error(base + ["--list-shapes", listed, "--measure", os.path.join(tmp, "m.json")],
                "give one of them", "list-shapes with measure")
    if os.path.exists(listed):
        failures.append("a refused --list-shapes wrote its file")
    check_error(base + ["--profile", "h100", "--link", "0"], "--link: bandwidth 0 GB/s is not positive",
                "zero link")
    check_error(base + ["--profile", "h100", "--link", "5,-1"], "latency -1 us is negative",
                "negative latency")
    check_error(base + ["--profile", "h100", "--link", "inf"], "bandwidth 'inf' is not a finite number",
                "infinite link")
    check_error(base + ["--profile", "nope"], "--profile 'nope' is neither a built-in profile",
                "unknown profile")
    check_error(base + ["--profile", "910b", "--dtype", "fp32"],
                "device.peak_flops.fp32 is null (not published", "unpublished peak")
    check_error(base + ["--profile", "h100", "--forms", "explicit", "--overlap", "on"],
                "(they overlap their collectives with compute); --forms includes none of them",
                "overlap without laga")
    check_error(["plan", "--preset", "tiny", "--seq", "4", "--sp", "8", "--profile", "h100"],
                "--sp 8 is more ranks than the 4 tokens of --seq 4", "P > S")
    check_error(base[:-1] + ["16", "--profile", "h100", "--nodes", "1"],
                "puts 16 ranks on a node, but profile h100 has 8 devices per node", "nodes")
    check_error(["plan", "--preset", "deepseek-v3", "--seq", "1048576", "--sp", "1",
                 "--attention", "eager", "--profile", "h100"],
                "--seq 1048576 fits no form at any --sp on h100", "fits nowhere")
    # The whole model's plan (--model): its options alone, beside --preset,
    # an EP degree that does not divide the experts, a bad model, a fit nowhere.
    moe_tiny = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs",
                            "assets", "moe_tiny.json")
    model = ["plan", "--profile", "h100", "--seq", "64", "--sp", "2"]
    check_error(model + ["--preset", "tiny", "--layers", "4"],
                "--layers plans a whole model's step; give --model NAME|FILE (deepseek-v3",
                "layers without model")
    check_error(model + ["--preset", "tiny", "--zero1"], "--zero1 plans a whole model's step",
                "zero1 without model")
    check_error(model + ["--model", moe_tiny, "--preset", "tiny"],
                "--model sets the attention block too", "model and preset")
    # P 3 over 8 experts folds them as laga train does (3 + 3 + 2): EP 3.
    uneven = load(["plan", "--profile", "h100", "--seq", "64", "--sp", "3", "--model", moe_tiny],
                  "ep_uneven")
    if {p["ep"] for p in uneven["plans"]} != {3}:
        failures.append(f"ep_uneven: --sp 3 over 8 experts planned EP "
                        f"{sorted({p['ep'] for p in uneven['plans']})}, want 3")
    check_error(model + ["--model", "deepseek-v4"], "deepseek-v4", "unknown model")
    check_error(model + ["--model", moe_tiny, "--ep", "3"],
                "--ep 3 must divide the 2 devices of --sp 2 x --dp 1", "ep 3")
    check_error(model + ["--model", moe_tiny, "--ep", "all"], "--ep", "ep all")
    check_error(model + ["--model", moe_tiny, "--ep", "world"], "--ep 'world' is none of sp",
                "ep world")
    check_error(model + ["--model", moe_tiny, "--dp", "0"], "--dp", "dp 0")
    check_error(model + ["--model", moe_tiny, "--micro-batches", "0"], "--micro-batches",
                "micro-batches 0")
    check_error(["plan", "--profile", "h100", "--seq", "4096", "--sp", "8", "--model",
                 "deepseek-v3"], "--seq 4096 fits no form at any --sp, --dp and --pp on h100",
                "model fits nowhere")
    # Pipeline stages, node-limited routing and FP8: each bad value named.
    check_error(model + ["--preset", "tiny", "--pp", "2"], "--pp plans a whole model's step",
                "pp without model")
    check_error(model + ["--model", moe_tiny, "--pp", "0"], "--pp", "pp 0")
    check_error(model + ["--model", moe_tiny, "--pp", "5"],
                "--pp 5 stages for 3 layers (the MTP module counted)", "pp past the layers")
    check_error(model + ["--model", moe_tiny, "--pp", "3", "--schedule", "dualpipe"],
                "--schedule dualpipe needs an even --pp", "dualpipe odd")
    check_error(model + ["--model", moe_tiny, "--pp", "2", "--stage-layers", "1,1"],
                "--stage-layers sums to 2 layers, and the model has 3", "stage layers sum")
    check_error(model + ["--model", moe_tiny, "--pp", "2,3", "--stage-layers", "1,2"],
                "--stage-layers gives one pipeline's stages; give one --pp", "stage layers pps")
    check_error(["plan", "--profile", "a100", "--seq", "64", "--sp", "2", "--model", moe_tiny,
                 "--fp8"],
                "device.peak_flops.fp8 is not given", "fp8 on a100")
    check_error(model + ["--model", moe_tiny, "--node-limit", "3"],
                "--node-limit 3 exceeds the EP group's 1 nodes", "node limit")
    check_error(model + ["--model", moe_tiny, "--comm-sms", "132/132"],
                "--comm-sms '132/132' is not USED/ALL", "comm sms")
    # The team search's global batch (plan/plan_search.hpp): each bad value named.
    check_error(model + ["--model", moe_tiny, "--global-batch", "0"], "--global-batch",
                "global batch 0")
    check_error(model + ["--model", moe_tiny, "--global-batch", "128", "--micro-batches", "2"],
                "give one of them", "global batch and micro-batches")
    check_error(model + ["--model", moe_tiny, "--global-batch", "100"],
                "--global-batch 100 tokens is no whole number of micro-batches", "global batch")
    check_error(model + ["--preset", "tiny", "--search"], "--search plans a whole model's step",
                "search without model")
    # A bf16 plan holding fp32 gradients names bf16 ones among the fixes.
    check_error(["plan", "--profile", "h100", "--seq", "4096", "--sp", "8", "--model",
                 "deepseek-v3"], "--grad-reduce bf16 (bf16 gradients", "fits nowhere: the fix")
    # Profiles with one bad field each, edited from the shipped h100.json.
    shipped = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "profiles",
                           "h100.json")
    with open(shipped) as f:
        good = json.load(f)
    for name, change, want in [
            ("zero_bw", lambda j: j["intra_node"].update(bytes_per_s=0),
             "intra_node.bytes_per_s = 0 must be positive and finite"),
            ("neg_bw", lambda j: j["inter_node"].update(bytes_per_s=-1e9),
             "inter_node.bytes_per_s = -1000000000.0 must be positive and finite"),
            ("missing", lambda j: j["device"].pop("memory_bytes"),
             "missing field device.memory_bytes"),
            ("unknown", lambda j: j.update(gpus=8), "unknown field gpus")]:
        j = json.loads(json.dumps(good))
        change(j)
        path = os.path.join(tmp, name + ".json")
        with open(path, "w") as f:
            json.dump(j, f)
        check_error(base + ["--profile", path], f"profile {path}: {want}", name)
elif case == "model":
    # --model: one plan per (S, P, DP, form) with exactly these fields; the
    # block it scales is the block plan's own (--layers 1 of a dense model:
    # the attention time is the block's step less its gradient all-reduce).
    moe_tiny = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs",
                            "assets", "moe_tiny.json")
    args = ["plan", "--quiet", "--profile", "h100", "--seq", "64,128", "--sp", "1,2",
            "--forms", "explicit,laga"]
    m = load(args + ["--model", moe_tiny, "--dp", "1,2", "--zero1"], "model")
    fields = ["form", "seq", "sp", "dp", "pp", "ep", "devices", "predicted_step_s",
              "predicted_tokens_per_s_per_device", "model_flops", "mfu", "attention_share",
              "seconds", "slowest_stage", "device_hours_per_1e12_tokens",
              "moe_a2a_bytes_per_rank", "moe_a2a_inter_node_bytes_per_rank",
              "p2p_bytes_per_rank", "stages", "memory", "block_step_s", "fits"]
    if len(m["plans"]) != 2 * 2 * 2 * 2:
        failures.append(f"model: {len(m['plans'])} plans, want 16")
    for p in m["plans"]:
        if list(p.keys()) != fields:
            failures.append(f"model plan fields {list(p.keys())} != {fields}")
            break
        parts = sum(p["seconds"].values())
        if abs(parts - p["predicted_step_s"]) > 1e-12 * p["predicted_step_s"]:
            failures.append(f"model {p['form']} S {p['seq']} P {p['sp']}: parts {parts} != step")
        if (p["sp"] == 1) != (p["moe_a2a_bytes_per_rank"] == 0):
            failures.append(f"model P {p['sp']}: a2a bytes {p['moe_a2a_bytes_per_rank']}")
    n = m["parameters"]
    if n["total"] != n["replicated"] + n["routed_experts"] or n["routed_experts"] != 2 * 8 * 3 * 64 * 32:
        failures.append(f"model parameters {n}")  # 2 MoE layers of 8 experts, 3 D I each
    if [d["devices"] for d in m["min_devices"]] != [1, 1]:
        failures.append(f"model min_devices {m['min_devices']}")
    # Pipeline stages (--pp 3, or 4 with the MTP module, each schedule): the parts still
    # sum to the step, a plan per device, P x DP x PP devices; the recipe is
    # the report's setup.
    for sched in ["1f1b", "interleaved", "dualpipe"]:
        pp = "4" if sched == "dualpipe" else "3"  # DualPipe at PP 2 has no bubble
        m = load(args + ["--model", moe_tiny, "--pp", pp, "--schedule", sched, "--mtp"],
                 "model_pp_" + sched)
        for p in m["plans"]:
            parts = sum(p["seconds"].values())
            if abs(parts - p["predicted_step_s"]) > 1e-12 * p["predicted_step_s"] or \
                    len(p["stages"]) != int(pp) or p["devices"] != p["sp"] * int(pp) or \
                    p["seconds"]["bubble"] <= 0:
                failures.append(f"model --pp {pp} {sched}: {p}")
                break
    r = load(["plan", "--quiet", "--recipe", "deepseek-v3"], "recipe", ok=(0, 2))
    p = r["plans"][0]
    if (p["devices"], p["pp"], p["dp"], p["sp"], p["ep"], p["seq"], r["schedule"], r["fp8"],
            r["node_limit"], r["mtp"], r["profile"]) != \
            (2048, 16, 128, 1, 64, 4096, "dualpipe", True, 4, True, "h800"):
        failures.append(f"recipe: {p['devices']} devices, PP {p['pp']}, DP {p['dp']}, "
                        f"EP {p['ep']}, {r['schedule']}, fp8 {r['fp8']}, {r['profile']}")
    # The block each layer scales is the block plan's, to the bit.
    one = ["plan", "--quiet", "--profile", "h100", "--seq", "64", "--sp", "2", "--forms",
           "explicit,laga"]
    block = load(one + ["--config", moe_tiny], "model_block")
    deep = load(one + ["--model", moe_tiny, "--layers", "1"], "model_one")
    if [p["form"] for p in deep["plans"]] != [p["form"] for p in block["plans"]]:
        failures.append(f"model forms {[p['form'] for p in deep['plans']]}")
    for b, p in zip(block["plans"], deep["plans"]):
        if b["predicted_step_s"] != p["block_step_s"]:
            failures.append(f"model {p['form']}: block step {p['block_step_s']} != the block "
                            f"plan's {b['predicted_step_s']}")
elif case == "measure":
    path = os.path.join(tmp, "this.json")
    tiny = ["--dtype", "fp32", "--preset", "tiny", "--sp", "2"]
    r = run(["plan", "--quiet", "--measure", path, "--seq", "64"] + tiny, timeout=120)
    if r.returncode != 0:
        sys.exit(f"FAILED: laga plan --measure exited {r.returncode}: {r.stderr}")
    with open(path) as f:
        prof = json.load(f)
    d = prof["device"]
    for k in ("gemm", "attention"):
        if not 0 < d["efficiency"][k] <= 1:
            failures.append(f"measured efficiency.{k} = {d['efficiency'][k]}")
    if d["peak_flops"]["bf16"] is not None or not d["peak_flops"]["fp32"] > 0:
        failures.append(f"measured peaks {d['peak_flops']}")
    # The elementwise kernels' exp rate: a CPU evaluates 10^7 to 10^10 a second.
    if not 1e7 < d.get("exp_per_s", 0) < 1e10:
        failures.append(f"measured exp_per_s = {d.get('exp_per_s')}")
    shapes = prof.get("measured_shapes", {})
    if not shapes.get("gemm") or not shapes.get("attention"):
        failures.append(f"no measured GEMM or attention shapes: {shapes}")
    elif any(not e["seconds"] > 0 for e in shapes["gemm"] + shapes["attention"]):
        failures.append("a measured shape took no time")
    p = load(["plan", "--quiet", "--profile", path, "--seq", "64"] + tiny, "with_measured")
    if len(p["plans"]) != len(FORMS):
        failures.append(f"plans with the measured profile: {p['plans']}")
    if any(ph["unmeasured_flops"] != 0 for plan in p["plans"] for ph in plan["phases"].values()):
        failures.append("a plan at the measured shapes has unmeasured FLOPs")
    for seq, want in (("64", "compute: every GEMM and attention call at its shape's measured time"),
                      ("96", "compute: all GEMM and attention FLOPs at the profile's efficiency")):
        r = run(["plan", "--profile", path, "--seq", seq] + tiny)
        if r.returncode != 0 or want not in r.stdout:
            failures.append(f"plan at S {seq} with the measured profile: want '{want}' in\n"
                            f"{r.stdout}{r.stderr}")
    # --list-shapes: the shapes --measure timed, each with its calls and FLOPs.
    listed = os.path.join(tmp, "listed.json")
    r = run(["plan", "--quiet", "--list-shapes", listed, "--seq", "64"] + tiny)
    if r.returncode != 0:
        sys.exit(f"FAILED: laga plan --list-shapes exited {r.returncode}: {r.stderr}")
    with open(listed) as f:
        lst = json.load(f)
    def keys(entries, drop):
        return sorted(json.dumps({k: v for k, v in e.items() if k not in drop}, sort_keys=True)
                      for e in entries)
    for kind in ("gemm", "attention"):
        if keys(lst[kind], ("calls", "flops")) != keys(shapes[kind], ("seconds",)):
            failures.append(f"--list-shapes {kind} differs from the shapes --measure timed")
        if any(not (e["calls"] >= 1 and e["flops"] > 0) for e in lst[kind]):
            failures.append(f"--list-shapes {kind}: a shape without calls or FLOPs")
    timed = dict(prof, measured_shapes={"dtype": "bf16", **{
        kind: [dict({k: v for k, v in e.items() if k not in ("calls", "flops")}, seconds=1e-3)
               for e in lst[kind]] for kind in ("gemm", "attention")}})
    timed["device"]["peak_flops"]["bf16"] = 1e12  # a bf16 plan needs a bf16 peak
    timed_path = os.path.join(tmp, "timed_bf16.json")
    with open(timed_path, "w") as f:
        json.dump(timed, f)
    # scripts/time_shapes_torch.py end to end on the CPU (the GPU is its
    # real place): it times the listed shapes, writes a profile the plan
    # costs them with, and refuses to write over an existing file. Debian's
    # torch 1.13 has no SDPA, so there only the GEMMs are timed.
    here = os.path.dirname(os.path.abspath(__file__))
    timer = os.path.join(here, "..", "..", "scripts", "time_shapes_torch.py")
    cpu_prof = os.path.join(tmp, "timed_cpu_fp32.json")
    if os.path.exists(cpu_prof):
        os.remove(cpu_prof)
    cmd = ["/usr/bin/python3", timer, listed, "--device", "cpu", "--dtype", "fp32", "--base", path,
           "--out", cpu_prof, "--min-ms", "0.2", "--repeats", "1", "--warmup", "0"]
    t = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if t.returncode != 0:
        failures.append(f"time_shapes_torch.py --device cpu exited {t.returncode}: {t.stderr}")
    else:
        with open(cpu_prof) as f:
            timed_cpu = json.load(f)["measured_shapes"]
        if timed_cpu["dtype"] != "fp32" or len(timed_cpu["gemm"]) != len(lst["gemm"]) or \
                any(not e["seconds"] > 0 for e in timed_cpu["gemm"] + timed_cpu["attention"]):
            failures.append(f"time_shapes_torch.py's profile: {timed_cpu}")
        r = run(["plan", "--profile", cpu_prof, "--seq", "64"] + tiny)
        want = ("every GEMM and attention call at its shape's measured time"
                if len(timed_cpu["attention"]) == len(lst["attention"])
                else "of the GEMM and attention FLOPs at their shapes' measured times")
        if r.returncode != 0 or want not in r.stdout:
            failures.append(f"a plan with time_shapes_torch.py's profile: want '{want}' in\n"
                            f"{r.stdout}{r.stderr}")
        again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if again.returncode == 0 or "exists" not in again.stderr:
            failures.append(f"time_shapes_torch.py wrote over {cpu_prof}: {again.stderr}")
    # The H200 timings shipped in docs/assets (docs/planning.md) cost every
    # call of laga's V3 plan they were listed from.
    h200 = os.path.join(here, "..", "..", "docs", "assets", "h200_measured_v3.json")
    r = run(["plan", "--profile", h200, "--preset", "deepseek-v3", "--seq", "32768", "--sp", "8",
             "--forms", "laga,ring_kv"])
    if r.returncode != 0 or "every GEMM and attention call at its shape's measured time" \
            not in r.stdout:
        failures.append(f"docs/assets/h200_measured_v3.json: {r.stdout}{r.stderr}")
    for dtype, want in (("bf16", "compute: every GEMM and attention call at its shape's measured time"),
                        ("fp32", "compute: all GEMM and attention FLOPs at the profile's efficiency")):
        r = run(["plan", "--profile", timed_path, "--seq", "64", "--preset", "tiny", "--sp", "2",
                 "--dtype", dtype])
        if r.returncode != 0 or want not in r.stdout:
            failures.append(f"{dtype} plan with bf16 timings: want '{want}' in\n"
                            f"{r.stdout}{r.stderr}")
else:
    sys.exit(f"unknown case {case}")

for m in failures:
    print("FAILED:", m)
sys.exit(1 if failures else 0)
