#!/usr/bin/env bash
# Run one phase of a longer job and print how long it took: hack/phase.sh NAME CMD...
name="$1"; shift
start=$(date +%s)
echo "::phase $name: started"
set +e
"$@"
rc=$?
echo "::phase $name: $(( $(date +%s) - start ))s (exit $rc)"
exit $rc
