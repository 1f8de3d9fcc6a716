#!/bin/bash
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
(timeout 300 python -m flashgen selftest --sanitize --sanitize-tools racecheck --out /tmp/st_rc > $OUT/rc.log 2>&1; cp /tmp/st_rc/selftest.txt $OUT/rc_selftest.txt; grep -v "Host Frame" /tmp/st_rc/sanitize/racecheck.log | grep -E "Race reported|and (Read|Write)|SUMMARY" > $OUT/racecheck.pairs) &
(timeout 300 python -m flashgen selftest --only mla,decode --out /tmp/st_mla > $OUT/mla.log 2>&1; cp /tmp/st_mla/selftest.txt $OUT/mla_selftest.txt) &
(timeout 430 python -m flashgen selftest --fuzz 500 --fuzz-start 500 --seed 0 --workers 8 --out /tmp/st_fz > $OUT/fz.log 2>&1; cp /tmp/st_fz/selftest.txt $OUT/fz_selftest.txt; cp /tmp/st_fz/selftest.json $OUT/fz_selftest.json) &
wait
cat $OUT/rc_selftest.txt | head -30; cat $OUT/mla_selftest.txt | head -14; cat $OUT/fz_selftest.txt | head -20
