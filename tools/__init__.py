"""Operator and user tools: produce, tail, backfill, bench, model builders, GPU check."""
