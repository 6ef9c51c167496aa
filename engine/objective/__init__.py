"""What a step minimises and how it updates: the chunked cross entropy, Liger's fused kernels,
the optimizer and LR schedule, and the optimizer step fused into backward.
"""
