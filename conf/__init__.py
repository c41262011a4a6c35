# Makes conf/ the package kimi.conf of an installed kimi (setup.py), which Hydra reads as pkg://kimi.conf: Hydra
# takes a config package only with an __init__.py (kimi/cli/conf_dir.py).
