"""The one thing pyproject.toml does not say: the analytics' frame walk in C (mtaq/analytics/_segment.c, issue 38.4).
It is optional: where no C compiler or Python headers are, the install goes on without it and the analytics
walk the frames with numpy, with the same results (mtaq.analytics.source._walk)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("mtaq.analytics._segment", ["mtaq/analytics/_segment.c"], extra_compile_args=["-O2"],
                             optional=True)])
