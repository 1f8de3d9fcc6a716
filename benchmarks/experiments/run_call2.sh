#!/bin/bash
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
cd benchmarks/experiments
(timeout 300 python tl_pad_diag.py > $OUT/diag.txt 2>&1) &
compute-sanitizer --help 2>&1 | grep -i -A2 "racecheck\|barrier" > $OUT/cs_help.txt
for m in noempty handover; do
  echo "== $m" >> $OUT/race.txt
  timeout 200 compute-sanitizer --tool racecheck python racecheck_control.py $m > $OUT/race_$m.log 2>&1
  grep -v "Host Frame" $OUT/race_$m.log | head -12 >> $OUT/race.txt
done
for opt in "--racecheck-indirect-barrier-dependency yes" "--racecheck-detect-level error"; do
  echo "== handover $opt" >> $OUT/race.txt
  timeout 200 compute-sanitizer --tool racecheck $opt python racecheck_control.py handover 2>&1 | grep -v "Host Frame" | head -10 >> $OUT/race.txt
done
wait
cat $OUT/cs_help.txt | head -40; cat $OUT/race.txt; cat $OUT/diag.txt | grep -v "^   launched" ; grep -m3 launched $OUT/diag.txt
