"""CPU kernels for a frozen target's forward: weight layouts of its Linear layers (stock, panel, blocks, tiles),
grouped attention, and the quiet-machine timing they are chosen by. Both the data build (train/) and the
inference engine (infer/) run the target through them. Also what the training steps run under: the allocator
switch (allocator.py: freed memory kept for the next step) and the training-time test's attention
(chain_attention.py)."""
