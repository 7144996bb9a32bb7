"""Compiler passes that turn a graph into something a backend can run (memory planning, ...).

Submodules are imported explicitly, e.g. ``from edgellm.compiler.memory import plan_memory``.
"""
