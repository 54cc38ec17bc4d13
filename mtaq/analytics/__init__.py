"""Delivery analytics on PySpark (the optional ``mtaq[spark]`` extra; the daemon never imports this package).

* :mod:`mtaq.analytics.source`: segment files -> Arrow batches with the daemon's codec (no Spark needed);
* :mod:`mtaq.analytics.datasource`: the ``mtaq`` Spark data source (``spark.read.format("mtaq")``);
* :mod:`mtaq.analytics.job`: the statistics job behind ``mtaq analyze``;
* :mod:`mtaq.analytics.report`: the Markdown report and its plots;
* :mod:`mtaq.analytics.plain`: the same headline totals from a plain single-process scan (the baseline);
* ``mtaq/analytics/submit.py``: the entry file for ``spark-submit``.

Nothing is imported here, so that importing the package costs nothing and needs no extra.
"""

__all__: list[str] = []
