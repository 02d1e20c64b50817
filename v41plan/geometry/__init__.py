"""Spec models, topology and byte geometry.

Importing this package loads no pydantic: the YAML/pydantic front end lives in
``v41plan.geometry.spec`` and is imported only by the compiler.
"""
