"""Metrics, dashboards and alerts of the control plane."""
