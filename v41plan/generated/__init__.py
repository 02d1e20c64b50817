"""v41plan.generated."""
