#!/usr/bin/env bash
# A new user's first contact, measured: a fresh clone, an empty pip cache, `.ci/bootstrap`, then the
# README's first command (`honcho start`, the adult-income job). Prints seconds, bytes received over
# the network, the venv's size, whether anything CUDA was installed, each step's rc and the job's test
# AUC, as a table and one JSON line.
#
#   bash benchmarks/cold_install.sh                 # clone this checkout's HEAD
#   REPO=https://host/persia-nats.git bash benchmarks/cold_install.sh
#   KEEP=1 ...                                      # leave the clone (its path is printed)
#
# Bytes are the receive counters of every interface but loopback over the bootstrap: other traffic on
# the machine in that window is counted too.
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
repo=${REPO:-$here}
work=$(mktemp -d /tmp/persia-cold.XXXXXX)
cleanup() { [ "${KEEP:-0}" = 1 ] || rm -rf "$work"; }
trap cleanup EXIT

rx_bytes() { awk -F'[: ]+' 'NR > 2 && $2 != "lo" { sum += $3 } END { printf "%d", sum }' /proc/net/dev; }

git clone -q "$repo" "$work/clone" || { echo "cold_install: cannot clone $repo" >&2; exit 1; }
cd "$work/clone"
# the shared data folder the examples may read sits beside a checkout
[ -d "$here/../shared" ] && ln -s "$here/../shared" "$work/shared"
export PIP_CACHE_DIR="$work/pip-cache"
rx0=$(rx_bytes)
t0=$(date +%s.%N)
bash .ci/bootstrap > "$work/bootstrap.log" 2>&1
boot_rc=$?
t1=$(date +%s.%N)
rx1=$(rx_bytes)
boot_s=$(echo "$t1 - $t0" | bc)
mb=$(echo "scale=1; ($rx1 - $rx0) / 1048576" | bc)
venv_mb=$(du -sm .venv 2>/dev/null | cut -f1)
cuda=$(ls .venv/lib/python3*/site-packages 2>/dev/null | grep -ciE '^(nvidia|triton|cuda)' || true)
torch=$(.venv/bin/python -c 'import torch; print(torch.__version__)' 2>/dev/null || echo none)

run_rc=skipped auc=null run_s=0
if [ "$boot_rc" = 0 ]; then
  t2=$(date +%s.%N)
  (. .venv/bin/activate && timeout 600 honcho start) > "$work/honcho.log" 2>&1
  run_rc=$?
  run_s=$(echo "$(date +%s.%N) - $t2" | bc)
  auc=$(grep -o '"test_auc": [0-9.]*' "$work/honcho.log" | tail -1 | awk '{print $2}')
  auc=${auc:-null}
else
  tail -20 "$work/bootstrap.log" >&2
fi

printf '\n%-34s %s\n' "step" "figure"
printf '%-34s %.1f s (rc %s)\n' ".ci/bootstrap, empty pip cache" "$boot_s" "$boot_rc"
printf '%-34s %s MiB\n' "received over the network" "$mb"
printf '%-34s %s MiB\n' ".venv on disk" "$venv_mb"
printf '%-34s %s (torch %s)\n' "CUDA packages installed" "$cuda" "$torch"
printf '%-34s %.1f s (rc %s), test AUC %s\n' "honcho start (adult-income)" "$run_s" "$run_rc" "$auc"
printf '{"date": "%s", "bootstrap_s": %.1f, "bootstrap_rc": %s, "received_mib": %s, "venv_mib": %s, "cuda_packages": %s, "torch": "%s", "honcho_s": %.1f, "honcho_rc": "%s", "test_auc": %s}\n' \
  "$(date -u +%FT%TZ)" "$boot_s" "$boot_rc" "$mb" "${venv_mb:-0}" "$cuda" "$torch" "$run_s" "$run_rc" "$auc"
[ "${KEEP:-0}" = 1 ] && echo "cold_install: kept $work" >&2
[ "$boot_rc" = 0 ] && [ "$run_rc" = 0 ] && [ "$auc" != null ] && [ "$cuda" = 0 ]
