"""Packaging lives in pyproject.toml; this shim lets tools that still call setup.py build it."""

from setuptools import setup

setup()
