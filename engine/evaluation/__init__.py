"""What is measured on held-out rows: the token-weighted loss over all ranks (`heldout`) and
batched greedy generation for the evaluate stage (`generation`).
"""
