"""What every inflightq process shares: settings, wire schemas, Redis key names,
the request lifecycle, errors and the queue client. Nothing here imports torch."""
