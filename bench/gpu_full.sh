#!/usr/bin/env bash
# The full GPU benchmark in one go, on the GPU machine: every workload on every runtime
# (python -m bench), the daemon's overhead and throughput (vkpool.daemon.bench), the five real
# models (bench.real_models) and GPU timestamps per dispatch (bench.gpu_profile).
#
# Usage: bash bench/gpu_full.sh start   # set up, then run everything in the background
#        bash bench/gpu_full.sh wait N  # wait up to N seconds; copy results to $OUT when done
# (The machine's commands are limited to 10 minutes each; the work takes longer, so it runs
# detached and later calls wait for it; results come back as $OUT/gpu-full.tgz.)
# Carry .gl, .whl and .glsl (see bench/gpu_run.sh); for the ncnn runtime .whl also holds, for
# Python 3.12: python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#   --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#   --platform manylinux2014_x86_64 -d .whl ncnn pnnx tqdm portalocker requests urllib3 idna certifi \
#   charset_normalizer
# The machine is given back 30 s after a call ends, detached work included: call `wait` again
# at once.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
RES=/tmp/full-out
if [ "${1:-}" = "start" ]; then
  bash bench/gpu_run.sh full x --devices-only > /tmp/setup.log 2>&1 || { cat /tmp/setup.log; exit 1; }
  rm -rf /tmp/bb "$RES" && mkdir -p /tmp/bb "$RES" && cp -r bench /tmp/bb/
  cat > /tmp/full.sh <<'EOF'
export PYTHONPATH=/tmp/site:/tmp/vkpool-src:/tmp/bb VKPOOL_CACHE_DIR=/tmp/vkcache PYTHONUNBUFFERED=1
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
RES=/tmp/full-out
cd /tmp
{ nvidia-smi; python3 -c "import torch, onnxruntime, numpy; print('torch', torch.__version__, 'onnxruntime', onnxruntime.__version__, 'numpy', numpy.__version__)"; python3 -c "import ncnn; print('ncnn', ncnn.__version__)"; } > $RES/versions.txt 2>&1
chmod +x /tmp/site/pnnx/pnnx  # ncnn's models are converted by pnnx (its wheel is in .whl)
python3 -m bench --out $RES/bench > $RES/bench.log 2>&1
python3 -m bench.workloads --out /tmp/models mnist12_like add_chain_1 matmul_1GB_1layer > /dev/null
python3 -m bench.startup_probe /tmp/models/mnist12_like.onnx --runs 4 > $RES/startup.txt 2>&1
python3 -m bench.gemv_probe --file /tmp/models/matmul_1GB_1layer.onnx --device vk0 > $RES/gemv-file.txt 2>&1
python3 -m vkpool.daemon.bench /tmp/models/mnist12_like.onnx /tmp/models/add_chain_1.onnx --runs 3000 --seconds 5 --out $RES/daemon-overhead.json > $RES/daemon-overhead.md 2>&1
# the lane's added time moves by several µs between runs: five more, the lane alone, and where it goes
for i in 1 2 3 4 5; do
  python3 -m vkpool.daemon.bench /tmp/models/mnist12_like.onnx /tmp/models/add_chain_1.onnx --runs 3000 --seconds 1 --clients 1 --transport lane 2>&1 | grep -E '^\| (mnist|add)'
done > $RES/daemon-lane-repeats.md
python3 -m bench.round_trip_split /tmp/models/mnist12_like.onnx /tmp/models/add_chain_1.onnx --runs 3000 > $RES/daemon-round-trip.md 2>&1
python3 -m bench.real_models --models-dir /tmp/real-models --out $RES/real_models.json > $RES/real_models.md 2>&1
for w in mnist12_like mlp conv_few_15MB conv_many_255MB matmul_1GB_16layers matmul_1GB_1layer add_chain_1000; do
  [ -f /tmp/models/$w.onnx ] || python3 -m bench.workloads --out /tmp/models $w > /dev/null
  python3 -m bench.gpu_profile /tmp/models/$w.onnx --device vk0 --top 8
done > $RES/gpu-profile.txt 2>&1
touch $RES/done
EOF
  setsid nohup bash /tmp/full.sh > /tmp/full.log 2>&1 < /dev/null &
  echo started
  exit 0
fi
deadline=$(( $(date +%s) + ${2:-540} ))
while [ ! -f $RES/done ] && [ "$(date +%s)" -lt "$deadline" ]; do sleep 5; done
tail -3 $RES/bench.log 2>/dev/null; ls $RES
if [ -f $RES/done ]; then
  # one archive: the transfer back takes at most 8 files
  (cd $RES && tar czf "$OUT/gpu-full.tgz" --exclude='bench/models' --exclude='bench/work' --exclude='bench/logs' .)
  echo finished
fi
