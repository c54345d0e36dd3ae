"""How people and orchestrators start things: CLI, local launcher, process entry points.

cli.py          `tunix-tasks ...` (parses, then calls the library)
entrypoints.py  prepare / actor / learner / report / eval for any orchestrator
launcher.py     `tunix-tasks train`: a learner and N actors on this machine, live display
report.py, evaluate.py, inspect.py   reading a run back
"""
