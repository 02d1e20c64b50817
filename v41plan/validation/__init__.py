"""Runtime acceptance (``validate_runtime``) and the deterministic fake runner its tests use."""
