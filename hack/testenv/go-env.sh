# Sourced by build.sh and build-prometheus.sh: the Go environment both build with. The
# checksum database may be out of reach here: GOSUMDB=off, and the committed go.sum files
# are the record of what was built. Module and build caches live under ~/.cache so that a
# warm machine rebuilds nothing.
command -v go >/dev/null || { echo "[testenv-build] Go is required (https://go.dev/dl); none on PATH" >&2; exit 1; }
export GOTOOLCHAIN=local CGO_ENABLED=0 GOSUMDB=off GOFLAGS=-mod=mod
export GOMODCACHE="${GOMODCACHE:-$HOME/.cache/hybridllm/go/mod}"
export GOCACHE="${GOCACHE:-$HOME/.cache/hybridllm/go/build}"
