#!/bin/bash
# the V fix on the GPU, the sanitizer with the racecheck triage, and a first slice of the fuzz
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi -L > $OUT/gpu.txt
(timeout 420 python -m flashgen selftest --only tl --out /tmp/st_tl > $OUT/tl.log 2>&1; cp /tmp/st_tl/selftest.txt $OUT/tl_selftest.txt) &
(timeout 300 python -m pytest -q -m gpu -p no:cacheprovider tests/test_selftest_fuzz.py -k "found_on_the_gpu or sanitize_set" > $OUT/found.txt 2>&1) &
(timeout 480 python -m flashgen selftest --sanitize --out /tmp/st_sz > $OUT/sz.log 2>&1; cp /tmp/st_sz/selftest.txt $OUT/sz_selftest.txt; cp /tmp/st_sz/sanitize/racecheck-control.log $OUT/ 2>/dev/null; for t in memcheck racecheck synccheck; do grep -v "Host Frame" /tmp/st_sz/sanitize/$t.log | head -150 > $OUT/$t.head; done) &
(timeout 540 python -m flashgen selftest --fuzz 500 --seed 0 --workers 8 --out /tmp/st_fz > $OUT/fz.log 2>&1; cp /tmp/st_fz/selftest.txt $OUT/fz_selftest.txt; cp /tmp/st_fz/selftest.json $OUT/fz_selftest.json) &
wait
tail -3 $OUT/found.txt; cat $OUT/tl_selftest.txt | head -20; cat $OUT/sz_selftest.txt | head -40; cat $OUT/fz_selftest.txt | head -30
