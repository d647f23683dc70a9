"""Benchmark protocol, tables and plots."""
