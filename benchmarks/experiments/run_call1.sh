#!/bin/bash
# racecheck control kernels + tl window/unaligned variants, one device call
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ROOT=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/gpu.txt
# template variants: phase-1 loop unpipelined (T1), phases 1 and 3 (T2)
for t in T1 T2; do
  rm -rf /tmp/$t; mkdir -p /tmp/$t
  tar cf - --exclude=.git . | tar xf - -C /tmp/$t
done
sed -i 's/^        for n0 in range(lo, full_lo, BLOCK_N):/        for n0 in tl.range(lo, full_lo, BLOCK_N, num_stages=1):/' /tmp/T1/templates/fwd.py.j2 /tmp/T2/templates/fwd.py.j2
sed -i 's/^    for n0 in range(full_hi, hi, BLOCK_N):/    for n0 in tl.range(full_hi, hi, BLOCK_N, num_stages=1):/' /tmp/T2/templates/fwd.py.j2
cd $ROOT/benchmarks/experiments
for m in base stages1 stages2 bm64 w8; do
  FLASHGEN_SELFTEST_CACHE=/tmp/c_$m timeout 400 python tl_window_unaligned.py $m > $OUT/tl_$m.txt 2>&1 &
done
for t in T1 T2; do
  (cd /tmp/$t/benchmarks/experiments && PYTHONPATH=/tmp/$t FLASHGEN_SELFTEST_CACHE=/tmp/c_$t timeout 400 python tl_window_unaligned.py base > $OUT/tl_$t.txt 2>&1) &
done
# racecheck controls (serial; small)
for m in handover nowait tma noshared; do
  echo "== $m" >> $OUT/race.txt
  timeout 120 python racecheck_control.py $m >> $OUT/race.txt 2>&1
  timeout 200 compute-sanitizer --tool racecheck python racecheck_control.py $m > $OUT/race_$m.log 2>&1
  grep -E "RACECHECK SUMMARY|Error: Race|hazard|right|WRONG" $OUT/race_$m.log | head -8 >> $OUT/race.txt
  timeout 200 compute-sanitizer --tool synccheck python racecheck_control.py $m > $OUT/sync_$m.log 2>&1
  grep -E "SUMMARY|error" $OUT/sync_$m.log | head -4 >> $OUT/race.txt
done
wait
cat $OUT/race.txt
for f in $OUT/tl_*.txt; do echo "== $f"; grep -E "PASS|FAIL|config|Error|error" $f | cut -c1-220; done
