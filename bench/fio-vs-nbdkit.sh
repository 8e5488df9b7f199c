#!/usr/bin/env bash
# 4 KiB random read and write at queue depth 1 and 32, fio's nbd engine over a Unix socket, for
# overspill (RAM tier, and a 16 MiB target that spills) and nbdkit's cow filter over the same
# golden image, in one run. Writes bench/results/fio-vs-nbdkit-<rev>.md.
# Usage: bench/fio-vs-nbdkit.sh [seconds per run, default 5]
# Superseded by bench/run (every server, cell, machine limit and the scale test in one run; see
# docs/performance.md); kept because it is short and its results are in bench/results/.
set -euo pipefail
cd "$(dirname "$0")/.."
runtime=${1:-5}
cargo build --release -q
bin=target/release/overspill
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$work"' EXIT
golden=$work/golden.img
head -c 1G /dev/zero | tr '\0' '\155' > "$golden"   # 1 GiB of data (not a hole)

serve() { # name, command...
  local sock=$work/$1.sock; shift
  rm -f "$sock"
  "$@" >"$work/server.log" 2>&1 &
  for _ in $(seq 100); do [ -S "$sock" ] && return; sleep 0.1; done
  echo "server $sock did not start" >&2; exit 1
}

run_fio() { # sock rw qd
  fio --name=b --ioengine=nbd --uri="nbd+unix:///?socket=$1" --rw="$2" --bs=4k --iodepth="$3" \
      --size=512m --time_based --runtime="$runtime" --output-format=json 2>/dev/null |
    python3 -c 'import json,sys; s=sys.stdin.read(); j=json.loads(s[s.index("{"):])["jobs"][0]; k="read" if j["read"]["io_bytes"] else "write"; p=j[k]["clat_ns"].get("percentile") or j[k]["lat_ns"].get("percentile") or {}; print("%.0f %.0f" % (j[k]["iops"], p.get("99.000000", 0)/1000))'
}

rev=$(git rev-parse --short HEAD)
out=bench/results/fio-vs-nbdkit-$rev.md
{
  echo "# fio 4 KiB random I/O, Unix socket, ${runtime} s per cell, $(nproc) cores, revision $rev"
  echo
  echo "| server | randread QD1 IOPS (p99 µs) | randread QD32 | randwrite QD1 | randwrite QD32 |"
  echo "| --- | --- | --- | --- | --- |"
} > "$out"
row() { # label sock-name command...
  local label=$1 name=$2; shift 2
  local cells=()
  for rw in randread randwrite; do
    for qd in 1 32; do
      serve "$name" "$@"
      read -r iops p99 < <(run_fio "$work/$name.sock" "$rw" "$qd")
      cells+=("$iops ($p99)")
      kill %% 2>/dev/null; wait 2>/dev/null || true
    done
  done
  echo "| $label | ${cells[0]} | ${cells[1]} | ${cells[2]} | ${cells[3]} |" >> "$out"
}
mkdir -p "$work/spill"
row "overspill ram+disk, 1G target (RAM tier)" o1 $bin serve --base "$golden" --listen unix:$work/o1.sock --ram 1G --ram-floor 0 --spill-dir "$work/spill" --anonymous-writes --log warn
row "overspill ram+disk, 16M target (spilling)" o2 $bin serve --base "$golden" --listen unix:$work/o2.sock --ram 16M --ram-floor 0 --spill-dir "$work/spill" --anonymous-writes --log warn
row "nbdkit --filter=cow file" k1 nbdkit --foreground --unix "$work/k1.sock" --filter=cow file "$golden"
row "nbdkit --filter=cow file cow-block-size=4096" k2 nbdkit --foreground --unix "$work/k2.sock" --filter=cow file "$golden" cow-block-size=4096
row "nbdkit memory" k3 nbdkit --foreground --unix "$work/k3.sock" memory 1G
cat "$out"
