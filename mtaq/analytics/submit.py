"""Entry file for ``spark-submit``: the same arguments as ``mtaq analyze`` (the master comes from spark-submit).

    spark-submit --master spark://host:7077 --py-files mtaq.zip mtaq/analytics/submit.py \\
        --segments s3a://bucket/archive --out /data/report --json
"""

from __future__ import annotations

import sys

from mtaq.analytics.command import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
