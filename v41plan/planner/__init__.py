"""v41plan.planner."""
