"""sglang-fleet-ops: plans, applies, drift and status of an sglang-fleet as data."""
