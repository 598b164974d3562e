"""Model definitions: config parsing, layers, model families, weight loading, the demo model."""
