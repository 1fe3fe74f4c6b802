//go:build tools

// Package tools pins Toxiproxy, which shapes the WAN between a site and the cloud in the
// tests and benchmarks (hack/topology/wan.py): latency, jitter, bandwidth and cuts per link.
package tools

import (
	_ "github.com/Shopify/toxiproxy/v2/cmd/server"
)
