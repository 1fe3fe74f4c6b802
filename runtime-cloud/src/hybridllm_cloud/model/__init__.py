"""Model definitions and weight loading (tensor math only; no scheduling state)."""
