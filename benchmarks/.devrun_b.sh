export PYTHONPATH=$PWD
timeout 60 python benchmarks/host_profile.py 2>&1 | head -70
timeout 200 python benchmarks/sweep.py --mode bwd --d 128 --n 4096 --tile 32,128,8,4 --tile 32,128,8,3 --tile 64,128,8,3 --tile 64,128,8,2 --tile 64,64,4,3 --tile 32,128,4,3 --out $OUT/sweep_tiles.json 2>&1 | tail -20
timeout 150 python benchmarks/sweep.py --mode bwd --d 128 --n 4096 --tile 32,128,8,4 --dq mirror --dq 128x64w8s2 --dq 128x64w8s3 --dq 128x32w8s3 --dq 64x64w4s3 --dq 64x32w4s4 --out $OUT/sweep_dq.json 2>&1 | tail -20
