"""The optional C accelerator (memdiff/_fastread.c). `optional=True`: where no compiler or Python
headers are found the build skips it and memdiff installs and runs on its pure-Python reader."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("memdiff._fastread", ["memdiff/_fastread.c"], optional=True)])
