"""The V4.1 model: configuration, quantizers, layers, Engram host half, checkpoints, the dense
reference and load-time weight sharding (torch; no pydantic, no ruamel.yaml)."""
