"""The layout planner, `python -m kimi.plan` (docs/planning.md): for a model on N GPUs of a kind, the
parallel layouts the project's rules accept, which fit in memory, and how fast each is predicted to train.

cluster.py holds the GPU kinds and the planner's keys, search.py enumerates and prunes the layouts,
timing.py predicts a step's time, report.py prints and writes the result, cli.py is the command; the
memory and communication models are memory.py and comm.py.
"""
