#!/usr/bin/env bash
# Makes sure a Vulkan loader and Mesa's software device (lavapipe) are installed.
# Installs them with apt-get when running as root on Debian/Ubuntu; otherwise prints the command.
set -eu
missing=()
for pkg in libvulkan1 mesa-vulkan-drivers; do
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$pkg")
  fi
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  if ldconfig -p 2>/dev/null | grep -q 'libvulkan.so.1'; then
    exit 0  # not Debian, but a Vulkan loader is there: trust it
  fi
  echo "vkpool needs a Vulkan loader (libvulkan.so.1) and a Vulkan driver; install them with your package manager." >&2
  exit 1
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "vkpool needs the Debian packages: ${missing[*]}" >&2
  echo "Run:  sudo apt-get update && sudo apt-get install -y ${missing[*]}" >&2
  echo "then run make again." >&2
  exit 1
fi
echo "installing ${missing[*]} with apt-get"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
