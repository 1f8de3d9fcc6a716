export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
(timeout 280 python -m pytest -m gpu -n 4 -q -p no:cacheprovider tests/ 2>&1 | tail -25) > $OUT/gpu_tests.txt; tail -3 $OUT/gpu_tests.txt
timeout 100 python benchmarks/suite.py --suite small --out $OUT/small --no-plot > $OUT/small.txt 2>&1; tail -20 $OUT/small.txt
