"""Device platforms verl-digen adds to veRL's platform registry."""
