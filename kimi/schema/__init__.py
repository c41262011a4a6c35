"""The configuration's ground floor: what every section's config is written with, below all of them.

kimi/config.py assembles the root ``Config`` from sections that live beside the code that owns each one
(kimi/model/config.py, kimi/data/config.py, kimi/optim/config.py, kimi/parallel/config.py,
kimi/precision/config.py). Those owners cannot import kimi.config (it imports them), so what they share lies
here, importing nothing of kimi but its error types (kimi/errors.py) and no torch:

  vocabulary.py  how a key is declared (one_of; registered, a registry table's entry) and how a rule is
                 written (check, require, check_choices, ...), and the root config's name in the floors'
                 annotations
  run.py         the run's own sections (trainer, logging), which the data loader, the precision and
                 parallel rules read below kimi.config while their owners (the trainer, kimi/run/) sit above
  pipeline.py    the pipeline's counts from the parallel section, which the precision rules (a floor below
                 kimi/parallel) read as the engine does
  stages.py      the run's stages (the root config's ``stages``), which kimi/run/stages.py runs

A package rather than a module at kimi/'s root, which holds the commands, the error types and the root
config (at most 10 modules, tests/project/test_structure.py); and not inside kimi/errors.py, which stays the
one concern of errors and exit codes.
"""
