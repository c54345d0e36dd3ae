"""How people and orchestrators start things: CLI, local launcher, process entry points.

cli.py          `tunix-tasks ...` (parses, then calls the library)
entrypoints.py  prepare / actor / learner / report / eval for any orchestrator
launcher.py     `tunix-tasks train`: a learner and N actors on this machine, live display
supervision.py  the launcher's child processes: start, watch, restart, stop
compile_cache.py  the persistent XLA compilation cache every actor, learner, eval uses
summary.py      the end of `tunix-tasks train`: its summary as a few lines
report.py, plots.py, evaluate.py, inspect.py   reading a run back; the report's figures
export.py       `tunix-tasks export`: a snapshot as a Hugging Face folder (full, PEFT, merged)
audit.py        the latency audit of a running fleet: which side waits
autopilot.py    the fleet's size from that audit: a pure policy, its decisions with reasons
fleet.py        `LocalFleet`: the launcher starts and stops actors as the autopilot decides
planning.py     planning before a run: the fleet, its staleness, the chips each role needs
"""
