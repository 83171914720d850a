#!/bin/bash
# perf/core_gaps_probes.sh SERVER : uprobes g/park and entry/return probes of the core's slice functions (tracefs)
BIN=$1
E=/sys/kernel/tracing/uprobe_events
echo > $E
# A uprobe takes a file offset: the symbol's address less its segment's (vaddr - offset).
delta=$(readelf -lW "$BIN" | awk '$1 == "LOAD" && $8 == "E" {print $3, $2}' | head -1 |
  python3 -c 'import sys; v, o = sys.stdin.read().split(); print(int(v, 16) - int(o, 16))')
off() { nm "$BIN" | awk -v p="$1" '$0 ~ p {print $1}' | sed -n "${2:-1}p" |
  python3 -c "import sys; print(hex(int(sys.stdin.read(), 16) - $delta))"; }
p() { echo "p:g/$1 $BIN:$2" >> $E; }
r() { echo "p:g/$1 $BIN:$2" >> $E; echo "r:g/$1_ret $BIN:$2" >> $E; }
p park "$(off '_ZN7glommio7parking5Inner4park17')"
r ingest_part "$(off 'CoreState11ingest_part17')"
r sweep_slice "$(off 'CoreState11sweep_slice17')"
r cap_build_slice "$(off 'CoreState15cap_build_slice17')"
r cap_slice_before "$(off 'CoreState16cap_slice_before17')"
r cap_enforce_slice "$(off 'CoreState17cap_enforce_slice17')"
r h2_turn "$(off 'http210connection.*9poll_turn17' 1)"
r h2_turn2 "$(off 'http210connection.*9poll_turn17' 2)"
wc -l < $E
