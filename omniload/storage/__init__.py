"""Where source files live: local disk, or an object store (S3, GCS, Azure, the Hugging Face Hub).

`urls` is pure (parsing, globbing, redaction) and safe to import anywhere; `stores`,
`objects` and `disk_cache` import pyarrow and run in workers and the indexing child only.
"""
