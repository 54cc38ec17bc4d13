"""Delivery analytics on PySpark (the optional ``mtaq[spark]`` extra; the daemon never imports this package).

* :mod:`mtaq.analytics.source`: segment files -> Arrow batches with the daemon's codec (no Spark needed);
* :mod:`mtaq.analytics.datasource`: the ``mtaq`` Spark data source (``spark.read.format("mtaq")``);
* :mod:`mtaq.analytics.facts`: the one definition of the per-message and per-recipient facts (pyarrow);
* :mod:`mtaq.analytics.partials`: the small tables' partial aggregates of those facts, and their sum;
* :mod:`mtaq.analytics.job`: the statistics job behind ``mtaq analyze`` (where each step runs);
* :mod:`mtaq.analytics.session`: its SparkSession (start, settings, stop);
* :mod:`mtaq.analytics.staging`: its Parquet files (the stage read back, tables written and published);
* :mod:`mtaq.analytics.percentiles`: exact percentiles from the delay buckets;
* :mod:`mtaq.analytics.summary`: the report's totals and small tables from the summed partials;
* :mod:`mtaq.analytics.state`: the incremental runs' state (``--state``);
* :mod:`mtaq.analytics.rejections`: the refusals from the daemon's event log (``--events``);
* :mod:`mtaq.analytics.report`: the Markdown report and its plots;
* :mod:`mtaq.analytics.plain`: the same headline totals from a plain single-process scan (the baseline);
* ``mtaq/analytics/submit.py``: the entry file for ``spark-submit``.

Nothing is imported here, so that importing the package costs nothing and needs no extra.
"""

__all__: list[str] = []
