"""Command-line modules: ``main`` dispatches ``v41plan
compile|explain|plan|init-checkpoint|run|bench``."""
