#!/bin/bash
# A seed fixes the text (issue 20): the same seeded sampled request five times under -k auto,
# then --draft none, then the same with --batch-invariant off; prints, per run, whether its
# tokens equal the batch-invariant --draft none run's, its speed and its K per step.
# Usage: bash benchmarks/seed_five_runs.sh [OUT_DIR]   (about 6 minutes on 2 cores)
set -u
cd "$(dirname "$0")/.."
out=${1:-seed-runs}
mkdir -p "$out"
run() { specdecode generate --chat-file examples/edit_function.txt --temperature 0.8 --seed 7 --json --quiet "${@:2}" \
          > "$out/$1.json" 2>/dev/null; }
for i in 1 2 3 4 5; do run "auto_$i"; done
run none --draft none
for i in 1 2 3; do run "off_$i" --batch-invariant off; done
run none_off --draft none --batch-invariant off
python - "$out" <<'P'
import glob, json, sys
ref = json.load(open(f"{sys.argv[1]}/none.json"))["token_ids"]
for f in sorted(glob.glob(f"{sys.argv[1]}/*.json")):
    d = json.load(open(f))
    a, s = d["token_ids"], d["stats"]
    j = next((i for i in range(min(len(a), len(ref))) if a[i] != ref[i]), None)
    same = "same as none" if a == ref else f"first diff {j}"
    print(f.split("/")[-1], len(a), same, "tok/s", s["decode_tokens_per_s"], "K", s["k_histogram"],
          "inv", s["invariant_block"])
P
