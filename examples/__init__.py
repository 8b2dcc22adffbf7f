"""Examples and demos that are not part of the product: see examples/README.md."""
