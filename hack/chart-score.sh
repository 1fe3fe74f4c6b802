#!/usr/bin/env bash
# Lints the chart (charts/hybridllm) as users install it with kube-score: renders it with
# `helm template` with its defaults and with every optional part on (the fleet server, the
# monitors, the PrometheusRule, the dashboards), scores the output and fails on any
# CRITICAL or WARNING finding not excused in hack/kube-score-excuses.txt (each excuse with
# its reason), and on an excuse that no finding needs any more. Part of `make lint`.
#
# helm and kube-score are the pinned builds of hack/testenv/build-helm.sh and
# build-kube-score.sh (cached under ~/.cache/hybridllm/testenv; a cold build says so and
# takes a minute or more). Needs python3 to read kube-score's JSON.
#
#   hack/chart-score.sh [CHART [EXCUSES]]   (default: charts/hybridllm hack/kube-score-excuses.txt)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# shellcheck source=testenv/versions.env
source hack/testenv/versions.env
chart="${1:-charts/hybridllm}"
excuses="${2:-hack/kube-score-excuses.txt}"
helm="$(hack/testenv/build-helm.sh)/bin/helm"
kube_score="$(hack/testenv/build-kube-score.sh)/bin/kube-score"
kube_version="${KUBERNETES_VERSION%.*}"   # the control plane the chart is tested on: v1.36

# The configurations users install: the defaults, and every optional template on.
declare -A configs=(
  [defaults]=""
  [everything]="fleet.enabled=true fleet.tls.secretName=fleet-tls monitoring.serviceMonitor.enabled=true monitoring.prometheusRule.enabled=true monitoring.dashboards.enabled=true"
)
# Optional checks that the chart passes and should keep passing.
optional=(container-seccomp-profile container-ports-check)

# The excuses: `ID reason` or `--ignore-container-{cpu,memory}-limit reason`.
known="$("$kube_score" list | cut -d, -f1)"
excused=()
while read -r id reason; do
  [[ -z "$id" || "$id" == \#* ]] && continue
  [ -n "$reason" ] || { echo "$excuses: $id has no reason" >&2; exit 1; }
  case "$id" in
    --ignore-container-cpu-limit|--ignore-container-memory-limit) ;;
    --*) echo "$excuses: $id is not an excuse kube-score takes" >&2; exit 1 ;;
    *) grep -qxF -- "$id" <<<"$known" || { echo "$excuses: $id is no kube-score test (kube-score list)" >&2; exit 1; } ;;
  esac
  excused+=("$id")
done <"$excuses"
ignore=()
for id in "${excused[@]}"; do
  if [[ "$id" == --* ]]; then ignore+=("$id"); else ignore+=(--ignore-test "$id"); fi
done

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
common=(score --kubernetes-version "$kube_version" --disable-ignore-checks-annotations --output-format json)
for t in "${optional[@]}"; do common+=(--enable-optional-test "$t"); done
for name in "${!configs[@]}"; do
  sets=()
  for v in ${configs[$name]}; do sets+=(--set "$v"); done
  "$helm" template hybridllm "$chart" -n hybridllm "${sets[@]}" >"$tmp/$name.yaml"
  # exit 1: a CRITICAL finding, read from the JSON below; anything else is kube-score failing
  for run in excused all; do
    flags=(); [ "$run" = excused ] && flags=("${ignore[@]}")
    rc=0; "$kube_score" "${common[@]}" "${flags[@]}" "$tmp/$name.yaml" >"$tmp/$name.$run.json" || rc=$?
    [ "$rc" -le 1 ] || { echo "kube-score failed on the $name rendering (exit $rc)" >&2; exit 1; }
  done
done

python3 - "$tmp" "$excuses" "$kube_version" "${excused[@]}" <<'PY'
import json, sys
from pathlib import Path

tmp, excuses_file, kube_version, *excused = sys.argv[1:]
# what kube-score's flags excuse, as (test id, finding summary) of a finding without them
FLAGS = {
    "--ignore-container-cpu-limit": ("container-resources", "CPU limit is not set"),
    "--ignore-container-memory-limit": ("container-resources", "Memory limit is not set"),
}
GRADES = {1: "CRITICAL", 5: "WARNING"}  # 7 (almost OK) and 10 pass


def findings(path):
    for obj in json.loads(Path(path).read_text()):
        for check in obj["checks"]:
            if check["skipped"] or check["grade"] not in GRADES:
                continue
            for c in check["comments"] or [{"summary": "", "path": "", "description": ""}]:
                yield obj, check, c


failed, used, objects = [], set(), 0
renderings = sorted(p.name.removesuffix(".excused.json") for p in Path(tmp).glob("*.excused.json"))
configs = len(renderings)
for config in renderings:
    objects += len(json.loads(Path(tmp, f"{config}.excused.json").read_text()))
    for obj, check, c in findings(Path(tmp, f"{config}.excused.json")):
        where = f"{obj['type_meta']['kind']}/{obj['object_meta']['name']}"
        if c.get("path"):
            where += f" ({c['path']})"
        failed.append(f"[{GRADES[check['grade']]}] {config}: {where}: {check['check']['id']}: "
                      f"{c['summary']}. {c['description']}".rstrip())
    for obj, check, c in findings(Path(tmp, f"{config}.all.json")):
        for ex in excused:
            if ex == check["check"]["id"] or FLAGS.get(ex) == (check["check"]["id"], c["summary"]):
                used.add(ex)

for line in failed:
    print(line)
stale = [ex for ex in excused if ex not in used]
for ex in stale:
    print(f"[STALE] {excuses_file}: {ex} excuses no finding any more: remove it")
if failed:
    print(f"kube-score: {len(failed)} finding(s) above; fix the chart, or excuse the check in "
          f"{excuses_file} with the reason")
if failed or stale:
    sys.exit(1)
print(f"kube-score (Kubernetes {kube_version}): {objects} objects scored in {configs} renderings, "
      f"no finding beyond the {len(excused)} excused in {excuses_file}")
PY
