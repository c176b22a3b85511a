"""Packages of the one `tokenmill` namespace, from the repository's folders (metadata is in pyproject.toml).

The design keeps its top-level folders; each installs under `tokenmill`: worker/ is `tokenmill`
itself, schemas/ `tokenmill.schemas`, kernels/ `tokenmill.kernels`, tools/ `tokenmill.tools`.
Nothing else lands in site-packages.
"""

from setuptools import find_packages, setup

ROOTS = {"tokenmill": "worker", "tokenmill.schemas": "schemas", "tokenmill.kernels": "kernels",
         "tokenmill.tools": "tools"}

packages: list[str] = []
for name, folder in ROOTS.items():
    packages += [name, *(f"{name}.{sub}" for sub in find_packages(folder))]

setup(packages=packages, package_dir=ROOTS)
