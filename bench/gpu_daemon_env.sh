# Sourced by the bench/gpu_daemon_*.sh scripts on the GPU machine: installs this checkout and the
# carried wheels (bench/gpu_run.sh --devices-only, once per machine), names the card, and exports
# what the daemon benches need (the NVIDIA driver, a shader cache, bench/ importable, py-spy on PATH).
set -uo pipefail
OUT=${OUT:-/tmp/out}
if [ -z "${VKPOOL_GPU_READY:-}" ]; then
  bash bench/gpu_run.sh daemon "" --devices-only > /tmp/setup.txt 2>&1 || { cat /tmp/setup.txt; exit 1; }
  nvidia-smi --query-gpu=name --format=csv,noheader
  rm -rf /tmp/benchpkg && mkdir -p /tmp/benchpkg && cp -r bench /tmp/benchpkg/
fi
icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
[ -f "$icd" ] || icd=$(ls /usr/share/vulkan/icd.d/nvidia*.json /etc/vulkan/icd.d/nvidia*.json 2>/dev/null | head -1)
export VK_DRIVER_FILES=$icd VKPOOL_CACHE_DIR=/tmp/vkcache PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
export PYTHONPATH=/tmp/site:/tmp/vkpool-src:/tmp/benchpkg VKPOOL_GPU_READY=1
# install_base: the tree at $BASE (a `git archive` of another commit, carried), when set, installed
# apart in /tmp/vkpool-base, for scripts that time it beside this one
install_base() {
  [ -n "${BASE:-}" ] || return 0
  (cd "$BASE" && python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade \
    --target /tmp/vkpool-base . > /dev/null) || exit 1
}
