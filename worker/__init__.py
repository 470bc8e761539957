"""The worker process: Redis -> engine -> Redis."""
