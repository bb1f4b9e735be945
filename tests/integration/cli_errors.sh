#!/usr/bin/env bash
# Bad input to the laga tool ends with exit status 2 and a message that names
# what was wrong — never a crash (status >= 128) or a silent success.
set -uo pipefail
laga=$1 tmp=$2
mkdir -p "$tmp"
fails=0
expect_error() {  # expect_error "needle in the message" args...
  local needle=$1; shift
  local out; out=$("$laga" "$@" 2>&1); local rc=$?
  if [ $rc -ne 2 ] || ! grep -qF -- "$needle" <<<"$out"; then
    echo "FAIL: laga $* -> rc=$rc, wanted 2 and '$needle' in:"; echo "$out" | head -5; fails=$((fails+1))
  else
    echo "ok: laga $* -> $(grep -F -- "$needle" <<<"$out" | head -1)"
  fi
}
echo '{"dim": 64, "n_heads": 4}' > "$tmp/missing.json"
echo '{"dim": 64, "n_heads": 4, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 5, "v_head_dim": 8}' > "$tmp/odd_rope.json"
echo '{"dim": 64,' > "$tmp/broken.json"
printf 'garbage' > "$tmp/garbage.st"
expect_error "unknown preset 'nope'" forward --preset nope
expect_error "missing 'kv_lora_rank'" forward --config "$tmp/missing.json"
expect_error "qk_rope_head_dim must be even" forward --config "$tmp/odd_rope.json"
expect_error "not valid JSON" forward --config "$tmp/broken.json"
expect_error "cannot open config file" forward --config "$tmp/none.json"
expect_error "garbage.st" forward --preset tiny --weights "$tmp/garbage.st"
expect_error "shorter than --sp 8" forward --preset tiny --seq 4 --sp 8
expect_error "unknown form 'lasp'" forward --preset tiny --form lasp
expect_error "'x' is not a whole number >= 1" verify --preset tiny --sp 2,x
[ $fails -eq 0 ] && echo "all error cases ok" || exit 1
