"""The only file-system code of mtaq, and the only fsync (GUIDE §2).

Segment files and the log with its group commit (:mod:`~mtaq.storage.log`), the file-system seam
(:mod:`~mtaq.storage.fs`, the one place that calls fsync), cursors over the log (:mod:`~mtaq.storage.cursor`),
checkpoint files, the ``corrupt`` area where damage is kept aside (:mod:`~mtaq.storage.quarantine`), the
segment archive, ``mtaq log dump|verify`` (:mod:`~mtaq.storage.logtools`), and small files replaced whole and
durably (:mod:`~mtaq.storage.cachefile`: the MTA-STS policy cache).

May import :mod:`mtaq.core` only (and the kill-point hook :mod:`mtaq.testing.killpoints`, which imports
nothing of mtaq). Nothing is imported here.
"""
