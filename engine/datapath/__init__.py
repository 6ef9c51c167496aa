"""Rows into micro-batches: the seeded global order and its shards (`data`), the DataLoader and
stream readers, background prefetch, and the packed / padding-free layouts with the varlen
attention they need.
"""
