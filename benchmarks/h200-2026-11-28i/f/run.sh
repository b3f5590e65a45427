#!/usr/bin/env bash
# Twenty-fifth session, call f: does the d = 128 short sequence forward (the persistent 128-row
# pairs at 512 / 1k) also gain without pingpong turns, as d = 64's did for full attention?
# tune.py --check (each candidate against the reference on awkward shapes first), two rounds.
set -u
o=$1; mkdir -p "$o"
timeout 200 python3 benchmarks/tune.py fwd --check --repeat 2 --jobs 4 --headdim 128 --seqlen 512 1024 \
  --configs 128,128,2,256,1,1,0,0,0 128,128,2,256,1,0,0,0,0 128,128,2,256,1,0,0,0,1 > "$o/tune.log" 2>&1
grep -E "^TUNE|CHECK|PASS|FAIL|Error" "$o/tune.log" > "$o/tune.txt"
python3 benchmarks/tune_table.py "$o/tune.txt" | tee "$o/tune_table.md"
grep -c "^PASS" "$o/tune.txt"; grep -iE "fail|error" "$o/tune.log" | head -5
