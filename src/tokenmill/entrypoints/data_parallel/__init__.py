"""Data parallelism: N engine replicas behind one front end (``--data-parallel-size``)."""
