"""The one thing pyproject.toml does not say: two modules in C, both optional. Where no C compiler or Python
headers are, the install goes on without them, with the same results:
- the analytics' frame walk (mtaq/analytics/_segment.c, issue 38.4); without it the analytics walk the frames
  with numpy (mtaq.analytics.source._walk);
- the byte passes over a message's text at each 250 and each delivery (mtaq/core/_octets.c, issue 36.5); without
  it the relay uses their definitions in Python (mtaq.core.octets)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("mtaq.analytics._segment", ["mtaq/analytics/_segment.c"], extra_compile_args=["-O2"],
                             optional=True),
                   Extension("mtaq.core._octets", ["mtaq/core/_octets.c"], extra_compile_args=["-O3"],
                             optional=True)])
