"""Package layout (the rest of the metadata is pyproject.toml's): specdistill/ and every package under it,
found by discovery (a new specdistill/kinds/<kind>/ needs no line here), plus the user's top-level folders
mapped into it: data/ -> specdistill.data, train/ -> specdistill.train, eval/ -> specdistill.eval."""
from setuptools import find_packages, setup

MAPPED = {"specdistill.data": "data", "specdistill.train": "train", "specdistill.eval": "eval"}

setup(packages=find_packages(include=["specdistill", "specdistill.*"]) + list(MAPPED),
      package_dir={"specdistill": "specdistill", **MAPPED})
