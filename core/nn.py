"""Neural-network primitives: convolution, pooling, normalization, padding, losses. (Being
written: see CONTRIBUTING.md, "A family of primitives".)"""
