//go:build tools

// Package tools pins kube-score, with which the rendered chart (charts/hybridllm) is
// linted in `make lint` (hack/chart-score.sh).
package tools

import (
	_ "github.com/zegl/kube-score/cmd/kube-score"
)
