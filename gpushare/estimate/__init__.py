"""The estimate: its document, the ``#GPUSHARE`` grammar, script discovery, the cache and where a job's estimate comes from."""
