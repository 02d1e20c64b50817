"""v41plan.codegen."""
