"""The model: its loading, runner, forwards, attention backends and CPU kernels."""
