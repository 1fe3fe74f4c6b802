//go:build tools

// Package tools pins helm and the helm-unittest plugin, with which the chart
// (charts/hybridllm) is linted, unit-tested, rendered and installed in the test suite.
package tools

import (
	_ "github.com/helm-unittest/helm-unittest/cmd/helm-unittest"
	_ "helm.sh/helm/v3/cmd/helm"
)
