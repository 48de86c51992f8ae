#!/usr/bin/env bash
# Starts the host services the fleet needs when they are not running (there is no systemd here):
# virtlogd (domain start fails without it) and libvirtd. Never starts any libvirt network.
set -euo pipefail
[ "$(id -u)" = 0 ] || { echo "libvirtd/virtlogd are started as root; skipping" >&2; exit 0; }
if ! pgrep -x virtlogd >/dev/null; then
  virtlogd -d
fi
if ! pgrep -x libvirtd >/dev/null; then
  libvirtd -d
fi
for _ in $(seq 1 50); do
  virsh -c qemu:///system version >/dev/null 2>&1 && exit 0
  sleep 0.1
done
echo "libvirtd did not answer on qemu:///system" >&2
exit 1
