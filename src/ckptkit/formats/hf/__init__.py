"""Hugging Face shards: ``index`` (the index read and checked, the split into shards) and
``write`` (a shard folder written torch-free, appearing whole or not at all)."""
