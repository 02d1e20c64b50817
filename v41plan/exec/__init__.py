"""v41plan.exec."""
