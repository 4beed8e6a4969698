#!/usr/bin/env bash
# Mutation testing of a change (docs/testing.md, "Mutation testing"):
# cargo-mutants mutates the lines of the core files that changed since
# STATESEAL_MUTANTS_BASE (default HEAD~1: CI sees a clone of main, so the
# last commit; set it to the commit a branch started from to cover a whole
# branch) and runs the tests that exercise those files, once unmutated first.
# A mutant no test catches fails this script, unless .cargo/mutants.toml
# lists it as equivalent.
#
# It mutates the tree in place (no second copy to build), so .ci/run calls it
# last, and the tree is restored from git however it ends. The run stops
# after STATESEAL_MUTANTS_SECONDS (default 1500): the mutants tested by then
# are judged and the rest reported as not tested; a run stopped before it
# tested any fails.
set -euo pipefail
cd "$(dirname "$0")/.."

base="${STATESEAL_MUTANTS_BASE:-HEAD~1}"
cap="${STATESEAL_MUTANTS_SECONDS:-1500}"
out="${TMPDIR:-/tmp}/stateseal-ci-mutants"

# The core, and the tests that exercise each part of it (cargo test name
# filters: `domain::` is every unit test under src/domain).
domain_tests="domain:: golden:: binding_vectors:: rfc8785:: properties::"
declare -A tests=(
  [src/domain/token.rs]="$domain_tests"
  [src/domain/codec.rs]="$domain_tests"
  [src/domain/keyring.rs]="$domain_tests rotation:: kek:: audit::"
  [src/domain/binding.rs]="$domain_tests"
  [src/domain/canon.rs]="$domain_tests"
  [src/domain/sealer.rs]="$domain_tests manifest:: grpc:: at_most_once:: sealer::"
  [src/domain/manifest.rs]="domain:: manifest::"
  [src/domain/credential.rs]="domain:: manifest::"
  [src/ledger/mod.rs]="ledger:: ledger_contract:: ledger_bound::"
  [src/ledger/journal.rs]="ledger:: ledger_contract::sled ledger_bound::"
  [src/ledger/sled.rs]="ledger:: ledger_contract::sled ledger_bound:: disk::an_unfinished_sled_snapshot disk::a_sled_writer_dead"
  [src/ledger/postgres.rs]="ledger::postgres:: ledger_contract::postgres ledger_contract::a_bad pg_tls:: replicas::database_down"
  [src/clock/guard.rs]="clock::"
)

files=()
filters=()
for f in "${!tests[@]}"; do
  if ! git diff --quiet "$base" -- "$f"; then
    files+=(-f "$f")
    read -r -a more <<<"${tests[$f]}"
    filters+=("${more[@]}")
  fi
done
if [ ${#files[@]} -eq 0 ]; then
  echo "no core file changed since $base: no mutants to test"
  exit 0
fi
mapfile -t filters < <(printf '%s\n' "${filters[@]}" | sort -u)

diff="$(mktemp)"
git diff --no-ext-diff --no-color --src-prefix=a/ --dst-prefix=b/ "$base" -- "${!tests[@]}" >"$diff"
echo "core files changed since $base: ${files[*]}"
[[ "$(cargo mutants --version)" == *27.1.0* ]] || { echo "cargo-mutants 27.1.0 is required" >&2; exit 1; }

# Mutated in place and restored from git: uncommitted changes there would be lost.
if ! git diff --quiet HEAD -- "${!tests[@]}"; then
  echo "FATAL: commit your changes to the core files first (the run restores them from git)" >&2
  exit 1
fi
rm -rf "$out"
restore() { git checkout -q -- "${!tests[@]}"; }
trap restore EXIT
rc=0
timeout --signal=INT --kill-after=60 "$cap" \
  cargo mutants --in-place --in-diff "$diff" "${files[@]}" \
    --timeout 300 --build-timeout 900 -o "$out" \
    -C --lib -C --test=it -- -- "${filters[@]}" || rc=$?
restore

m="$out/mutants.out"
# Lines in one of cargo-mutants' lists (it writes each, empty when none).
count() { if [ -f "$m/$1" ]; then awk 'NF { n++ } END { print n + 0 }' "$m/$1"; else echo 0; fi; }
echo "mutants: caught $(count caught.txt), missed $(count missed.txt), timeout $(count timeout.txt), unviable $(count unviable.txt)"
if [ "$(count missed.txt)" != 0 ]; then
  echo "FATAL: mutants no test caught (add a test, or list an equivalent mutant in .cargo/mutants.toml and count it in docs/testing.md's table):"
  cat "$m/missed.txt"
  exit 1
fi
tested=$(($(count caught.txt) + $(count missed.txt) + $(count timeout.txt)))
case "$rc" in
  0 | 3) ;; # all caught, or some caught by a test timeout
  124 | 130)
    [ "$tested" -gt 0 ] || { echo "FATAL: the ${cap} s cap stopped the run before it tested any mutant"; exit 1; }
    echo "the ${cap} s cap stopped the run: the $tested mutants above were tested, the rest were not" ;;
  4) echo "FATAL: the tests fail on the unmutated tree"; tail -n 40 "$m/log/baseline.log" 2>/dev/null || true; exit 1 ;;
  *) echo "FATAL: cargo mutants exited $rc"; tail -n 40 "$m/debug.log" 2>/dev/null || true; exit 1 ;;
esac
