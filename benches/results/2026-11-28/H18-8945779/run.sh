#!/usr/bin/env bash
# Run H18 (2026-11-28, the 2-core development machine, no GPU): an n-way request's cost and the
# normal traffic beside it, before (8ab2107: each completion recomputes the prompt's last block)
# and after (8945779: the completions fork it and compute one token each), one binary after the
# other on the same machine. Both are dev-profile (optimized) builds, as the e2e suite runs.
#   OLD=/tmp/oldtarget/debug/mla-serve NEW=target/debug/mla-serve benches/results/2026-11-28/H18-8945779/run.sh
set -euo pipefail
here="$(dirname "$0")"
python3 scripts/n_way_probe.py --bin "$OLD" --out "$here/n_way-8ab2107.json" | tee "$here/run.log"
python3 scripts/n_way_probe.py --bin "$NEW" --out "$here/n_way-8945779.json" | tee -a "$here/run.log"
