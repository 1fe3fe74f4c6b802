"""Model definitions, weight loading and the paged KV cache they read and write (tensor math
only; no scheduling state)."""
