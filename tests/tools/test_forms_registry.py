#!/usr/bin/python3
"""The two form registries cannot drift (issue 54, "Registries that cannot drift").

Usage: test_forms_registry.py LAGA

  * the package's registry (python/laga_torch/forms.py, FORMS) equals the
    C++ one as this build has it (`laga forms --json`, read off the rows in
    src/mla/forms.def's order): the same names in the same order (a form
    either side lacks is named), and per row the same traits (query_latent,
    overlap, head_groups, reference, exact_at_one_rank), the same place of
    each rank's attention (attends: heads | grid | own) and the same way the
    keys reach it (keys: heads | latent | gather | ring, with the ring's
    block);
  * exactly one reference row, both sides: the C++ JSON names one, the
    package's reference_form() is it, and the package's registry() refuses
    rows with two references (every pair of forms), with none, or with a
    name twice (the C++ side: tests/mla/test_form_registry.cpp);
  * the help of --q-latent, --overlap and --head-groups in every command
    that takes them (compare, forward, plan, train, verify) names exactly
    the forms whose row has the trait, and no other.
"""

import copy
import json
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

TRAITS = ("query_latent", "overlap", "head_groups", "reference", "exact_at_one_rank")
# The options whose help names the forms with a trait, and the commands
# that take them.
HELP = {"--q-latent": ("query_latent", ("compare", "forward", "plan", "train", "verify")),
        "--overlap": ("overlap", ("compare", "forward", "plan", "train", "verify")),
        "--head-groups": ("head_groups", ("compare", "forward", "plan", "train", "verify"))}

failures = []


def fail(msg):
    failures.append(msg)
    print("FAIL: " + msg)


def run(cmd):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       timeout=60)
    if p.returncode != 0:
        sys.exit(f"FAIL: {' '.join(cmd)} exited {p.returncode}\n{p.stdout}\n{p.stderr}")
    return p.stdout


def package_row(f):
    """The package's row in the JSON's terms."""
    row = {"name": f.name, "traits": {t: getattr(f, t, None) for t in TRAITS},
           "attends": f.attends.name, "keys": f.keys.name}
    if f.ring:
        row["ring_block"] = f.codec.pass_label[:-len("_ring")]
    return row


def cxx_row(j):
    row = {"name": j["name"], "traits": {t: bool(j["traits"][t]) for t in TRAITS},
           "attends": j.get("attends"), "keys": j.get("keys"),
           "invariant": j["traits"].get("invariant")}
    if "ring_block" in j:
        row["ring_block"] = j["ring_block"]
    return row


def check_rows(cxx, lt):
    mine = [package_row(f) for f in lt.FORMS.values()]
    theirs = [cxx_row(j) for j in cxx["forms"]]
    names_c, names_p = [r["name"] for r in theirs], [r["name"] for r in mine]
    only_c = [n for n in names_c if n not in names_p]
    only_p = [n for n in names_p if n not in names_c]
    if only_c:
        fail(f"the C++ registry has {', '.join(only_c)}, the package's (laga_torch.FORMS) has "
             "not: add its row to python/laga_torch/forms.py")
    if only_p:
        fail(f"the package's registry has {', '.join(only_p)}, the C++ one (laga forms) has not")
    if not only_c and not only_p and names_c != names_p:
        fail(f"the registries' order differs: C++ {names_c}, package {names_p}")
    by_name = {r["name"]: r for r in mine}
    for r in theirs:
        p = by_name.get(r["name"])
        if p is None:
            continue
        for t in TRAITS:
            if p["traits"][t] is not r["traits"][t]:
                fail(f"form {r['name']}: trait {t} is {r['traits'][t]} in the C++ registry, "
                     f"{p['traits'][t]} in the package's")
        for k in ("attends", "keys", "ring_block"):
            if p.get(k) != r.get(k):
                fail(f"form {r['name']}: {k} is {r.get(k)} in the C++ registry, "
                     f"{p.get(k)} in the package's")
        # invariant: each side's row says which forms its own mode covers
        # (docs/pytorch_invariant.md, docs/invariance.md); the two offer it for
        # the same forms (a trainer picking a form for an RL run reads one table)
        pkg = bool(getattr(lt.FORMS[r["name"]], "invariant", False))
        if r["invariant"] is not None and bool(r["invariant"]) != pkg:
            fail(f"form {r['name']}: the C++ registry {'offers' if r['invariant'] else 'does not offer'}"
                 f" the invariant mode, the package's row {'does' if pkg else 'does not'} "
                 "(FormSpec.invariant, python/laga_torch/forms.py; FormTraits::invariant)")
    cxx_inv = [r["name"] for r in theirs if r["invariant"]]
    pkg_inv = [f.name for f in lt.FORMS.values() if getattr(f, "invariant", False)]
    print(f"registries: {len(theirs)} C++ rows, {len(mine)} package rows compared; invariant: "
          f"package {', '.join(pkg_inv)}; C++ " +
          (", ".join(cxx_inv) if any(r["invariant"] is not None for r in theirs) else
           "(laga forms --json lists no invariant trait: not compared)"))


def check_reference(cxx, lt):
    refs = [j["name"] for j in cxx["forms"] if j["traits"]["reference"]]
    if len(refs) != 1 or cxx.get("reference") != refs[0]:
        fail(f"laga forms --json: reference rows {refs}, reference {cxx.get('reference')}")
    if not hasattr(lt.forms, "reference_form") or not hasattr(lt.forms, "registry"):
        fail("the package has no reference_form() or registry() (forms.py): nothing reads "
             "its one reference row or refuses two")
        return
    if lt.forms.reference_form() != cxx.get("reference"):
        fail(f"the package's reference_form() is {lt.forms.reference_form()}, the C++ "
             f"registry's {cxx.get('reference')}")
    rows = list(lt.FORMS.values())
    refused = 0
    for i in range(len(rows)):
        for j in range(i + 1, len(rows)):
            two = [copy.copy(f) for f in rows]
            for f in two:
                f.reference = False
            two[i].reference = two[j].reference = True
            try:
                lt.forms.registry(two)
                fail(f"the package's registry() took two reference rows ({rows[i].name} and "
                     f"{rows[j].name})")
            except ValueError as e:
                if "exactly one reference" not in str(e) or rows[j].name not in str(e):
                    fail(f"two references: the message does not say what is wrong: {e}")
                refused += 1
    none = [copy.copy(f) for f in rows]
    for f in none:
        f.reference = False
    twice = [copy.copy(f) for f in rows] + [copy.copy(rows[-1])]
    twice[-1].reference = False
    for what, bad, words in (("no reference", none, "exactly one reference"),
                             ("a name twice", twice, "more than once")):
        try:
            lt.forms.registry(bad)
            fail(f"the package's registry() took {what}")
        except ValueError as e:
            if words not in str(e):
                fail(f"{what}: the message does not say what is wrong: {e}")
            refused += 1
    print(f"reference: {cxx.get('reference')} both sides; {refused} bad registries refused")


def option_help(text, option):
    """The help paragraph of `option` in CLI11's --help text: its line and
    the continuation lines up to the next option."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if re.match(rf"\s+{re.escape(option)}\b", line):
            out = [line]
            for more in lines[i + 1:]:
                if re.match(r"\s*-", more) or not more.strip() or re.match(r"\S", more):
                    break
                out.append(more)
            return " ".join(out)
    return None


def named(text, names):
    """The registry's names a text names as words (laga is not laga2d)."""
    return {n for n in names if re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", text)}


def check_help(laga, cxx):
    names = [j["name"] for j in cxx["forms"]]
    checked = 0
    for option, (trait, commands) in HELP.items():
        want = {j["name"] for j in cxx["forms"] if j["traits"][trait]}
        for cmd in commands:
            h = option_help(run([laga, cmd, "--help"]), option)
            if h is None:
                fail(f"laga {cmd} --help has no {option}")
                continue
            got = named(h, names)
            if got != want:
                fail(f"laga {cmd} --help: {option} names {sorted(got)}; the forms with "
                     f"{trait} are {sorted(want)}\n  {h.strip()}")
            checked += 1
    print(f"help: {checked} option texts checked against the forms with their trait")


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    laga = sys.argv[1]
    import laga_torch as lt
    cxx = json.loads(run([laga, "forms", "--json", "-"]))
    check_rows(cxx, lt)
    check_reference(cxx, lt)
    check_help(laga, cxx)
    if failures:
        sys.exit(f"FAIL: {len(failures)} disagreement(s) between the registries")
    print("PASS")


if __name__ == "__main__":
    main()
