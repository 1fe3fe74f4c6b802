//go:build tools

// Package tools pins Prometheus, the metrics server of the test environment: it scrapes
// the pods' metrics endpoints and serves the HTTP query API (/api/v1/query) to what reads them.
package tools

import _ "github.com/prometheus/prometheus/cmd/prometheus"
