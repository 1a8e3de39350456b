"""The C part of the package: deltad._savedcore, the saved-tensor hooks'
hot path, on CPython's stable ABI (one build for every CPython from 3.10).
Everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("deltad._savedcore",
                  ["deltad/_savedcore.c", "deltad/_savedcore_store.c",
                   "deltad/_savedcore_hooks.c", "deltad/_savedcore_types.c"],
                  depends=["deltad/_savedcore.h"], py_limited_api=True),
    ],
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
