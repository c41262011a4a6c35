"""The package layout, which pyproject.toml cannot say: the kimi packages, and the presets in conf/ shipped as
the package data of ``kimi.conf`` (conf/ stays where the checkout, the tests and the benches read it;
kimi/cli/conf_dir.py finds either). Everything else about the package is in pyproject.toml."""

from setuptools import find_namespace_packages, setup

setup(packages=[*find_namespace_packages(include=["kimi", "kimi.*"]), "kimi.conf"],
      package_dir={"kimi.conf": "conf"},
      package_data={"kimi.conf": ["**/*.yaml"], "kimi.eval.tasks": ["*.yaml", "*.jsonl"]})
