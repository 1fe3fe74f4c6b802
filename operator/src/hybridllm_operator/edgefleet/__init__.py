"""Edge fleet: enrollment, signed configs, heartbeats and waves (docs/fleet.md)."""
