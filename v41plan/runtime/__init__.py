"""The paged runtime: PAGE/STATE pools, kernel backends, the paged model, CUDA graphs,
collectives and torchrun plumbing (no pydantic, no ruamel.yaml)."""
