"""Package discovery for pdlab: every package below the top-level folders becomes `pdlab.<folder>...`.

The folder layout is fixed (kernels/, moe/, attention/, runtime/, tuning/, bench/ at the top) and the
import name is `pdlab.<folder>`; setuptools' find cannot add that prefix, so this file does.
"""
from setuptools import find_packages, setup

TOP = ["kernels", "attention", "moe", "runtime", "tuning", "bench"]
found = find_packages(where=".", include=[f"{t}" for t in TOP] + [f"{t}.*" for t in TOP])
setup(packages=["pdlab"] + [f"pdlab.{p}" for p in found])
