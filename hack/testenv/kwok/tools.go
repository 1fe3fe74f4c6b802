//go:build tools

// Package tools pins kwok, which fakes nodes and pod readiness for the test control plane.
package tools

import _ "sigs.k8s.io/kwok/cmd/kwok"
