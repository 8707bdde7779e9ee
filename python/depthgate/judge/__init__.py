"""Steps 5 and 6, score and gate: the deterministic oracle, control scoring and the statistical gate."""
