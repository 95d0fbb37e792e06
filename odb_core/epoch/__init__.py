"""Epoch: running one epoch on one rank and the public loader around it. `ODBDataLoader`, the round pipeline
(fill the buffer, plan, align, collate, yield), the sample stream over DataLoader workers and the reader that
buffers it, the background producer, epoch-length estimates, and the lifeline that ends workers with their rank.
The top layer: may import every other odb_core package."""
