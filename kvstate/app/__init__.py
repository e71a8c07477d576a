"""Applications built on the library: the command line and the byte-checked demo."""
