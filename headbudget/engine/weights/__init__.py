"""A checkpoint's weights as numpy arrays laid out for every budget, shared by the backends."""
