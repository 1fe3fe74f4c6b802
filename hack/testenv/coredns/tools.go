//go:build tools

// Package tools pins CoreDNS, the cluster DNS of the test environment's real node: pods
// resolve Service names (NAME.NAMESPACE.svc) through it, as on any cluster.
package tools

import _ "github.com/coredns/coredns"
